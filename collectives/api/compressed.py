"""compressed_allreduce and compressed_reducescatter: the public 1-bit averaged allreduce
and reducescatter with error feedback (the algorithm: collectives/compression/onebit.py),
sync and async."""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives.algorithms.onebit import error_sizes, scatter_error_size
from collectives.api import calls, on_device, process_sets
from collectives.api.base import need_dim0, row_elems
from collectives.compression.onebit import ONEBIT, OnebitState, check_block, check_error, check_x
from collectives.ops import ReduceOp
from collectives.runtime import topology
from collectives.runtime.buffers import host_float, is_device_data, store_float, wrap
from collectives.runtime.engine import Handle, Job
from collectives.runtime.p2p import even_split


def compressed_allreduce(x: Any, worker_error: Any, server_error: Any,
                         block_size: int | None = None, *, out: Any = None,
                         comm: Any = None) -> Any:
    """The average of x over all ranks, each value sent as one bit (see the module doc).

    x: a floating NumPy array, torch tensor or CuPy array; with device error buffers on x's
    device, device data is compressed, served and decompressed on the device and only the
    packets are staged (else through the host). The result is a new array of x's type,
    dtype, shape and device, the same on every rank. worker_error, server_error: this
    rank's float32 1-D error buffers of error_sizes(x.size, world size) elements, zeros at
    first, updated in place (keep them for the next call on the same vector). block_size:
    None for DeepSpeed's scales (one for the whole vector on the worker side, one per chunk
    on the server side), or one scale per block of this many elements within each chunk
    (finer, for 4/block_size more bytes per element). out: an array of x's type, dtype,
    shape and device to write the result into instead (x itself for in place; returned).
    comm: the mpi4py communicator to run over (default: the job's)."""
    topo = topology.of(comm)
    with calls.Prepared(topo, "compressed_allreduce", None) as p:
        p.call, p.job = _prepare(topo, x, worker_error, server_error, block_size, out)
    return p.run()


def compressed_allreduce_async(x: Any, worker_error: Any, server_error: Any,
                               block_size: int | None = None, *, out: Any = None,
                               comm: Any = None) -> Any:
    """compressed_allreduce queued on the engine: returns a Handle for synchronize(); the
    error buffers (and out) must not be touched until it completes."""
    topo = topology.of(comm)
    with calls.Prepared(topo, "compressed_allreduce", None) as p:
        p.call, p.job = _prepare(topo, x, worker_error, server_error, block_size, out)
    return p.submit()


def _check_out(out: Any, x: Any) -> None:
    """out as compressed_allreduce writes it: x's type, dtype, shape and device."""
    if type(out) is not type(x):
        raise TypeError(f"out: expected a {type(x).__name__} as x, got {type(out).__name__}")
    if out.dtype != x.dtype or tuple(out.shape) != tuple(x.shape) \
            or getattr(out, "device", None) != getattr(x, "device", None):
        raise ValueError(f"out: expected x's dtype {x.dtype}, shape {tuple(x.shape)} and "
                         f"device, got {out.dtype}, {tuple(out.shape)}, "
                         f"{getattr(out, 'device', 'host')}")


def _prepare(topo: topology.Topology, x: Any, worker_error: Any, server_error: Any,
             block_size: Any, out: Any = None) -> tuple[calls.Call, Job]:
    if out is not None:
        _check_out(out, x)
    if is_device_data(x) and is_device_data(worker_error) \
            and on_device.compressible(x):
        return on_device.onebit(topo, x, worker_error, server_error, block_size, out)
    buf = check_x(x)
    into = None if out is None else wrap(out, "out")
    if into is not None and not into.staged and not buf.staged \
            and np.shares_memory(into.flat, buf.flat) \
            and into.flat.__array_interface__["data"] != buf.flat.__array_interface__["data"]:
        raise ValueError("out: overlaps x without being x")
    block = check_block(block_size)
    padded, chunk = error_sizes(buf.flat.size, topo.size)
    worker = check_error(worker_error, "worker_error", padded)
    server = check_error(server_error, "server_error", chunk)
    fields = (("dtype", buf.dtype), ("shape", buf.shape), ("block_size", block))
    call = calls.describe(topo, "compressed_allreduce", fields, ONEBIT.name)
    state = OnebitState(worker.flat, server.flat, block)

    def move() -> Any:
        dest = buf.empty(buf.shape) if into is None else into
        direct = dest.dtype == "float32"  # the average is float32: written where it goes
        values = ONEBIT.allreduce(topo, host_float(buf.flat, buf.dtype), ReduceOp.Average,
                                  "auto", state, dest.flat if direct else None)
        if not direct:
            store_float(dest.flat, dest.dtype, values)
        worker.write_back()
        server.write_back()
        if into is None:
            return dest.result()
        into.write_back()
        return out

    return call, Job(move)


def compressed_reducescatter(x: Any, worker_error: Any, block_size: int | None = None, *,
                             comm: Any = None, process_set: Any = None) -> Any:
    """This rank's rows (Horovod's row split, as reducescatter's) of the average of x over
    all ranks, each value sent as one bit with error feedback: every rank compresses its
    rows for rank j (one scale per block of block_size elements, or one for them all) and
    sends them to rank j, which decompresses and sums them in rank order.

    x: a floating host array or tensor (device data is staged) with at least one
    dimension. worker_error: this rank's float32 1-D buffer of
    algorithms.onebit.scatter_error_size(counts) elements, counts[j] = rank j's rows x
    the row's elements; zeros at first, updated in place (keep it for the next call on the
    same vector). The result has x's type and dtype."""
    topo = process_sets.resolve(comm, process_set)
    with calls.Prepared(topo, "compressed_reducescatter", None) as p:
        p.call, p.job = _prepare_scatter(topo, x, worker_error, block_size)
    return p.run()


def compressed_reducescatter_async(x: Any, worker_error: Any, block_size: int | None = None,
                                   *, comm: Any = None, process_set: Any = None) -> Handle:
    """compressed_reducescatter queued on the engine: a Handle for synchronize(); the
    error buffer must not be touched until it completes."""
    topo = process_sets.resolve(comm, process_set)
    with calls.Prepared(topo, "compressed_reducescatter", None) as p:
        p.call, p.job = _prepare_scatter(topo, x, worker_error, block_size)
    return p.submit()


def _prepare_scatter(topo: topology.Topology, x: Any, worker_error: Any,
                     block_size: Any) -> tuple[calls.Call, Job]:
    buf = check_x(x)
    need_dim0(buf, "x")
    block = check_block(block_size)
    rows = even_split(buf.shape[0], topo.size)
    counts = [r * row_elems(buf.shape) for r in rows]
    worker = check_error(worker_error, "worker_error", scatter_error_size(counts))
    fields = (("dtype", buf.dtype), ("shape", buf.shape), ("block_size", block))
    call = calls.describe(topo, "compressed_reducescatter", fields, ONEBIT.name)
    state = OnebitState(worker.flat, None, block)

    def move() -> Any:
        out = buf.empty((rows[topo.rank],) + buf.shape[1:])
        store_float(out.flat, out.dtype, ONEBIT.reducescatter(
            topo, host_float(buf.flat, buf.dtype), counts, ReduceOp.Average, "auto", state))
        worker.write_back()
        return out.result()

    return call, Job(move)
