"""Adasum (Horovod's adaptive summation): a reduction that adds orthogonal vectors and
averages parallel ones, so that combining gradients or model deltas from many ranks does
not overshoot as a plain sum would.

For two vectors a and b:

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a term whose norm is zero contributes nothing), applied recursively over the ranks as a
binary tree: ranks 2i and 2i+1 combine, then pairs of pairs, and so on, which is why the
number of ranks must be a power of two. Dot products and the combination are computed in
float64; the result is rounded to the input's dtype.

Cost: log2(n) steps, each exchanging the whole vector with one partner (recursive
doubling: both partners compute the same combination, the lower rank's vector as a, so
every rank ends with the same bits): log2(n) (alpha + m beta) and 3m flops per step."""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives.api import calls, process_sets
from collectives.dtypes import FLOATING
from collectives.runtime.buffers import host_float, store_float, wrap
from collectives.runtime.engine import Job
from collectives.runtime.p2p import count

_TAG = 31


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """adasum(a, b) of two float64 vectors."""
    dot = float(np.dot(a, b))
    norm_a, norm_b = float(np.dot(a, a)), float(np.dot(b, b))
    coef_a = 1.0 - dot / (2.0 * norm_a) if norm_a > 0 else 1.0
    coef_b = 1.0 - dot / (2.0 * norm_b) if norm_b > 0 else 1.0
    return coef_a * a + coef_b * b


def _prepare(topo: Any, x: Any) -> tuple[calls.Call, Job]:
    buf = wrap(x, "x")
    if buf.dtype not in FLOATING:
        raise TypeError(f"x: Adasum reduces floating tensors, got {buf.dtype}")
    n = topo.size
    if n & (n - 1):
        raise ValueError(f"op: Adasum needs a power-of-two number of ranks, got {n}")
    fields = (("op", "Adasum"), ("dtype", buf.dtype), ("shape", buf.shape))
    call = calls.describe(topo, "adasum_allreduce", fields, "adasum")

    def move() -> Any:
        mine = host_float(buf.flat, buf.dtype).astype(np.float64)
        distance = 1
        while distance < n:
            peer = topo.rank ^ distance
            theirs = np.empty_like(mine)
            topo.comm.Sendrecv(mine, dest=peer, sendtag=_TAG, recvbuf=theirs, source=peer,
                               recvtag=_TAG)
            count(topo.comm, mine.nbytes, theirs.nbytes)
            mine = combine(mine, theirs) if topo.rank < peer else combine(theirs, mine)
            distance <<= 1
        out = buf.empty(buf.shape)
        store_float(out.flat, out.dtype, mine)
        return out.result()

    return call, Job(move)


def allreduce(x: Any, *, name: str | None = None, comm: Any = None,
              process_set: Any = None) -> Any:
    """The Adasum of every rank's x (a floating NumPy array, torch tensor or CuPy array), as
    a new array like x."""
    topo = process_sets.resolve(comm, process_set)
    with calls.Prepared(topo, "adasum_allreduce", name) as p:
        p.call, p.job = _prepare(topo, x)
    return p.run()
