"""reducescatter and grouped_reducescatter: rows split by Horovod's rule (even_split)."""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives import algorithms
from collectives.api import calls, process_sets
from collectives.api.base import (
    check_list,
    check_reduction,
    compressed_into,
    need_dim0,
    one_dtype,
    row_elems,
    scale,
)
from collectives.api.calls import Call, Prepared
from collectives.auto import select
from collectives.compression import Compression, check_compression
from collectives.dtypes import FLOATING, STORAGE
from collectives.ops import KERNEL_OP, ReduceOp
from collectives.runtime import topology
from collectives.runtime.buffers import wrap
from collectives.runtime.engine import Handle, Job
from collectives.runtime.p2p import even_split

# ------------------------------------------------------------------------- reducescatter


def _reducescatter(topo: topology.Topology, x: Any, op: Any, algorithm: Any,
                   compression: Any = None, prescale_factor: Any = 1.0,
                   postscale_factor: Any = 1.0) -> tuple[Call, Job]:
    op, scaling, pre, post = check_reduction(op, algorithm, prescale_factor, postscale_factor)
    compressor = check_compression(compression)
    buf = wrap(x, "x")
    need_dim0(buf, "x")
    fields = (("op", op.name), ("dtype", buf.dtype), ("shape", buf.shape),
              ("algorithm", algorithm)) + scaling
    if compressor is not Compression.none and buf.dtype in FLOATING:
        return _compressed(topo, buf, op, algorithm, compressor, fields, pre, post)
    call = calls.describe(topo, "reducescatter", fields,
                          select.concrete(topo, "reducescatter", algorithm, buf.nbytes))
    send = buf.flat
    if pre != 1:  # a scaled copy: x is the caller's
        send = np.empty_like(buf.flat)
        scale(buf.flat, send, buf.dtype, pre)

    def move() -> Any:
        rows = even_split(buf.shape[0], topo.size)
        elems = row_elems(buf.shape)
        out = buf.empty((rows[topo.rank],) + buf.shape[1:])
        algorithms.reducescatter(call.algorithm, topo, send, out.flat,
                                 [r * elems for r in rows], KERNEL_OP[op], buf.dtype)
        algorithms.average(out.flat, buf.dtype, op, topo.size)
        if post != 1:
            scale(out.flat, out.flat, buf.dtype, post)
        return out.result()

    return call, Job(move)


def _compressed(topo: topology.Topology, buf: Any, op: ReduceOp, algorithm: Any,
                compressor: Any, fields: tuple, pre: float, post: float) -> tuple[Call, Job]:
    """A floating reducescatter under a compressor (compression/), counted under its
    name: the compressed values travel, this rank's rows are decompressed."""
    compressor.check_op(op)
    compressor.check_count(buf.flat.size)
    call = calls.describe(topo, "reducescatter", fields + (("compression", compressor.name),),
                          compressor.name)

    def move() -> Any:
        rows = even_split(buf.shape[0], topo.size)
        elems = row_elems(buf.shape)
        out = buf.empty((rows[topo.rank],) + buf.shape[1:])
        compressed_into(out, buf, pre, post, lambda values: compressor.reducescatter(
            topo, values, [r * elems for r in rows], op, algorithm))
        return out.result()

    return call, Job(move)


def reducescatter(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto", *,
                  compression: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, name: str | None = None, comm: Any = None,
                  process_set: Any = None) -> Any:
    """This rank's rows of the reduction of x over all ranks (Horovod's row split).
    compression (Compression.fp16 or int8; floating x only) compresses what travels."""
    topo = process_sets.resolve(comm, process_set)
    with Prepared(topo, "reducescatter", name) as p:
        p.call, p.job = _reducescatter(topo, x, op, algorithm, compression, prescale_factor,
                                       postscale_factor)
    return p.run()


def reducescatter_async(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto", *,
                        compression: Any = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, name: str | None = None,
                        comm: Any = None, process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    with Prepared(topo, "reducescatter", name) as p:
        p.call, p.job = _reducescatter(topo, x, op, algorithm, compression, prescale_factor,
                                       postscale_factor)
    return p.submit()


def _grouped_reducescatter(topo: topology.Topology, tensors: Any, op: Any, algorithm: Any,
                           prescale_factor: Any = 1.0, postscale_factor: Any = 1.0
                           ) -> tuple[Call, Job]:
    op, scaling, pre, post = check_reduction(op, algorithm, prescale_factor, postscale_factor)
    check_list(tensors)
    bufs = [wrap(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    for i, b in enumerate(bufs):
        need_dim0(b, f"tensors[{i}]")
    dtype = one_dtype(bufs)
    nbytes = sum(b.nbytes for b in bufs)
    fields = (("op", op.name), ("dtype", dtype), ("shapes", tuple(b.shape for b in bufs)),
              ("algorithm", algorithm)) + scaling
    call = calls.describe(topo, "grouped_reducescatter", fields,
                          select.concrete(topo, "reducescatter", algorithm, nbytes))
    n, r = topo.size, topo.rank
    rows = [even_split(b.shape[0], n) for b in bufs]
    elems = [row_elems(b.shape) for b in bufs]
    # the send buffer ordered by destination: rank j's rows of every tensor, then j + 1's
    pieces = []
    for j in range(n):
        for b, split, e in zip(bufs, rows, elems):
            start = sum(split[:j]) * e
            pieces.append(b.flat[start:start + split[j] * e])
    send = np.concatenate(pieces) if pieces else np.empty(0, STORAGE[dtype])
    if pre != 1:
        scale(send, send, dtype, pre)
    counts = [sum(split[j] * e for split, e in zip(rows, elems)) for j in range(n)]

    def move() -> list:
        recv = np.empty(counts[r], STORAGE[dtype])
        algorithms.reducescatter(call.algorithm, topo, send, recv, counts, KERNEL_OP[op],
                                 dtype)
        algorithms.average(recv, dtype, op, n)
        if post != 1:
            scale(recv, recv, dtype, post)
        outs, at = [], 0
        for b, split, e in zip(bufs, rows, elems):
            out = b.empty((split[r],) + b.shape[1:])
            out.flat[...] = recv[at:at + split[r] * e]
            at += split[r] * e
            outs.append(out.result())
        return outs

    return call, Job(move)


def grouped_reducescatter(tensors: list, op: ReduceOp = ReduceOp.Average,
                          algorithm: str = "auto", *, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, name: str | None = None,
                          comm: Any = None, process_set: Any = None) -> list:
    """reducescatter of every tensor of the list in one call: one agreement and one fused
    reducescatter (each tensor split by Horovod's row rule). One dtype per group."""
    topo = process_sets.resolve(comm, process_set)
    with Prepared(topo, "grouped_reducescatter", name) as p:
        p.call, p.job = _grouped_reducescatter(topo, tensors, op, algorithm, prescale_factor,
                                               postscale_factor)
    return p.run()


def grouped_reducescatter_async(tensors: list, op: ReduceOp = ReduceOp.Average,
                                algorithm: str = "auto", *, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0, name: str | None = None,
                                comm: Any = None, process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    with Prepared(topo, "grouped_reducescatter", name) as p:
        p.call, p.job = _grouped_reducescatter(topo, tensors, op, algorithm, prescale_factor,
                                               postscale_factor)
    return p.submit()


