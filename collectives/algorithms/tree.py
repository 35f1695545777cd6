"""Latency-optimal collectives: O(log n) steps for any world size.

How it works. Non-powers of two are folded first, as MPICH does: with p the largest power
of two <= n and e = n - p, each even rank below 2e hands its data to the odd rank above it
and sits out; the p remaining ranks run the power-of-two algorithm; the folded ranks get
their result back at the end.
  allreduce      recursive doubling: at distance d = 1, 2, 4, ... partners swap their
                 partial results and both fold (lower rank's data first, so both compute
                 the same bits)
  reducescatter  recursive halving: at distance p/2, p/4, ... partners swap the half of
                 their current range the other keeps, and fold it
  allgather      Bruck: at distance 1, 2, 4, ... send everything held so far; any n, no fold
  broadcast      binomial tree from the root

Cost for n ranks and m bytes (alpha latency + o our per-message overhead, beta seconds per
byte, gamma seconds per byte reduced; d = log2 p + 2[e>0] recursive-doubling steps, the
fold in and out counted), as cost() computes it:
  allreduce      d (alpha+o) + d m beta + (log2 p + [e>0]) m gamma
  reducescatter  d (alpha+o) + ((p-1)/p + [e>0]) m beta + ((p-1)/p + [e>0]) m gamma
  allgather      ceil(log2 n) (alpha+o) + (n-1)/n m beta
  broadcast      ceil(log2 n) (alpha+o) + ceil(log2 n) m beta
Latency wins for small messages; ring wins on bandwidth for large ones.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from collectives import kernels
from collectives.algorithms.costmodel import Layout, Params, log2_steps
from collectives.dtypes import CODES
from collectives.kernels import _C
from collectives.ops import ReduceOp
from collectives.runtime.engine import ENGINE
from collectives.runtime.p2p import irecv, isend, offsets
from collectives.runtime.watchdog import wait_all

TAG_FOLD, TAG_RD, TAG_RH, TAG_BRUCK, TAG_BCAST = 21, 22, 23, 24, 25
#: Largest allreduce message: MPI counts are C ints.
MAX_MESSAGE_BYTES = 1 << 30


def _exchange(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, peer: int, tag: int) -> None:
    reqs = [irecv(comm, recv, peer, tag), isend(comm, send, peer, tag)]
    wait_all(comm, reqs, "tree")


def fold_shape(n: int) -> tuple[int, int]:
    """(p, e): the largest power of two <= n and the number of extra ranks."""
    p = 1 << (n.bit_length() - 1)
    return p, n - p


def _virtual(r: int, e: int) -> int:
    """Rank among the p active ranks, or -1 for a folded (sitting-out) rank."""
    if r < 2 * e:
        return r // 2 if r % 2 else -1
    return r - e


def _real(v: int, e: int) -> int:
    return 2 * v + 1 if v < e else v + e


def _fold(comm: MPI.Comm, buf: np.ndarray, tmp: np.ndarray, e: int, op: ReduceOp,
          dtype: str) -> None:
    """Each even rank below 2e hands buf to the odd rank above, which folds it in first."""
    r = comm.Get_rank()
    if r >= 2 * e:
        return
    if r % 2 == 0:
        wait_all(comm, [isend(comm, buf, r + 1, TAG_FOLD)], "tree")
    else:
        wait_all(comm, [irecv(comm, tmp, r - 1, TAG_FOLD)], "tree")
        kernels.reduce(buf, [tmp, buf], dtype, op)


def allreduce(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
              dtype: str) -> None:
    """recv = reduction of every rank's send (send may be recv), by recursive doubling:
    the agreement's exchange in C++ (csrc/runtime/agree.cpp) without the check, so both
    run one implementation and fold in the same order. Elements are independent, so
    buffers past MAX_MESSAGE_BYTES (MPI counts are C ints) go in pieces."""
    code, step = CODES[dtype], max(1, MAX_MESSAGE_BYTES // recv.itemsize)
    for lo in range(0, max(recv.size, 1), step):
        piece = slice(lo, min(lo + step, recv.size))
        _C.tree_allreduce(ENGINE.native, comm, TAG_RD, send[piece], recv[piece],
                          recv[piece].size, code, int(op))


def reducescatter(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, counts: list[int],
                  op: ReduceOp, dtype: str) -> None:
    """recv = this rank's block (counts[rank] elements) of the reduction of every send,
    by recursive halving; active rank v owns the blocks of the ranks folded into it."""
    n, r = comm.Get_size(), comm.Get_rank()
    bounds = offsets(counts)
    if n == 1:
        recv[...] = send
        return
    p, e = fold_shape(n)
    acc = send.copy()
    tmp = np.empty_like(acc)
    _fold(comm, acc, tmp, e, op, dtype)
    v = _virtual(r, e)
    if v >= 0:
        # element range of active rank u's blocks: its own, or the folded pair's two
        def lo(u: int) -> int:
            return bounds[2 * u] if u < e else bounds[u + e]

        def hi(u: int) -> int:  # exclusive
            return bounds[2 * u + 2] if u < e else bounds[u + e + 1]

        first, last = 0, p  # active ranks whose blocks this rank still holds
        d = p >> 1
        while d >= 1:
            mid = first + d
            peer_v = v ^ d
            if v < mid:
                keep, give, last = (lo(first), lo(mid)), (lo(mid), hi(last - 1)), mid
            else:
                keep, give, first = (lo(mid), hi(last - 1)), (lo(first), lo(mid)), mid
            k0, k1 = keep
            _exchange(comm, acc[give[0]:give[1]], tmp[k0:k1], _real(peer_v, e), TAG_RH)
            srcs = [acc[k0:k1], tmp[k0:k1]] if v < peer_v else [tmp[k0:k1], acc[k0:k1]]
            kernels.reduce(acc[k0:k1], srcs, dtype, op)
            d >>= 1
    if r < 2 * e:  # the odd rank holds both blocks of the pair
        if r % 2:
            wait_all(comm, [isend(comm, acc[bounds[r - 1]:bounds[r]], r - 1, TAG_FOLD)], "tree")
        else:
            wait_all(comm, [irecv(comm, acc[bounds[r]:bounds[r + 1]], r + 1, TAG_FOLD)], "tree")
    recv[...] = acc[bounds[r]:bounds[r + 1]]


def allgather(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
    """recv = every rank's send in rank order, by Bruck's algorithm (any n)."""
    n, r = comm.Get_size(), comm.Get_rank()
    bounds = offsets(counts)
    order = [(r + i) % n for i in range(n)]  # blocks held in rotated order r, r+1, ...
    offs = offsets([counts[b] for b in order])
    rotated = np.empty_like(recv)
    rotated[:counts[r]] = send
    have = 1
    while have < n:
        k = min(have, n - have)
        reqs = [irecv(comm, rotated[offs[have]:offs[have + k]], (r + have) % n, TAG_BRUCK),
                isend(comm, rotated[:offs[k]], (r - have) % n, TAG_BRUCK)]
        wait_all(comm, reqs, "tree")
        have += k
    split = bounds[r]  # undo the rotation: blocks r.. go first in rotated, at bounds[r] in recv
    recv[split:] = rotated[:offs[n - r]]
    recv[:split] = rotated[offs[n - r]:]


def broadcast(comm: MPI.Comm, buf: np.ndarray, root: int) -> None:
    """buf on every rank = buf on root, down a binomial tree."""
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1 or buf.size == 0:
        return
    rel = (r - root) % n
    mask = 1
    while mask < n:  # receive from the parent: clear the lowest set bit of rel
        if rel & mask:
            wait_all(comm, [irecv(comm, buf, (r - mask) % n, TAG_BCAST)], "tree")
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if rel + mask < n:
            sends.append(isend(comm, buf, (r + mask) % n, TAG_BCAST))
        mask >>= 1
    wait_all(comm, sends, "tree")


def doubling_steps(n: int) -> int:
    """Steps of recursive doubling over n ranks: log2 p, plus the fold in and out of the
    extra ranks when n is not a power of two (also the agreement exchange's step count)."""
    p, e = fold_shape(n)
    return p.bit_length() - 1 + (2 if e else 0)


def cost(collective: str, nbytes: int, layout: Layout, p: Params) -> float:
    """Predicted seconds of one call on layout (the formulas in the module docstring)."""
    n, m = layout.size, nbytes
    if n <= 1:
        return 0.0
    step, beta = layout.message(p)
    pow2, extra = fold_shape(n)
    d = doubling_steps(n)
    if collective == "allreduce":
        return d * step + d * m * beta + (d - (1 if extra else 0)) * m * p.gamma
    if collective == "reducescatter":
        moved = ((pow2 - 1) / pow2 + (1 if extra else 0)) * m
        return d * step + moved * (beta + p.gamma)
    if collective == "allgather":
        return log2_steps(n) * step + (n - 1) / n * m * beta
    return log2_steps(n) * (step + m * beta)
