"""compressed_allreduce, grouped_compressed_allreduce and compressed_reducescatter: the
public 1-bit averaged allreduce (of one vector, or of several in one call) and
reducescatter with error feedback (the algorithm: collectives/compression/onebit.py), sync
and async."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from collectives.algorithms.onebit import error_sizes, scatter_error_size
from collectives.api import calls, on_device, process_sets
from collectives.api.base import need_dim0, row_elems
from collectives.compression.onebit import ONEBIT, OnebitState, check_block, check_error, check_x
from collectives.ops import ReduceOp
from collectives.runtime import topology
from collectives.runtime.buffers import Buffer, host_float, is_device_data, store_float, wrap
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


def _check_out(out: Any, x: Any, name: str = "out") -> None:
    """out as compressed_allreduce writes it: x's type, dtype, shape and device."""
    if type(out) is not type(x):
        raise TypeError(f"{name}: expected a {type(x).__name__} as x, got "
                        f"{type(out).__name__}")
    if out.dtype != x.dtype or tuple(out.shape) != tuple(x.shape) \
            or getattr(out, "device", None) != getattr(x, "device", None):
        raise ValueError(f"{name}: expected x's dtype {x.dtype}, shape {tuple(x.shape)} and "
                         f"device, got {out.dtype}, {tuple(out.shape)}, "
                         f"{getattr(out, 'device', 'host')}")


def _prepare(topo: topology.Topology, x: Any, worker_error: Any, server_error: Any,
             block_size: Any, out: Any = None) -> tuple[calls.Call, Job]:
    if out is not None:
        _check_out(out, x)
    if is_device_data(x) and is_device_data(worker_error) \
            and on_device.compressible(x):
        return on_device.onebit(topo, x, worker_error, server_error, block_size, out)
    block = check_block(block_size)
    part = _Part.check(topo, x, worker_error, server_error, out,
                       ("x", "worker_error", "server_error", "out"))
    fields = (("dtype", part.buf.dtype), ("shape", part.buf.shape), ("block_size", block))
    call = calls.describe(topo, "compressed_allreduce", fields, ONEBIT.name)
    return call, Job(lambda: _run(topo, [part], block)[0])


class _Part(NamedTuple):
    """One vector of a host compressed_allreduce, checked: x, its error buffers and out
    (None: a new result) as Buffers, and the caller's out object."""

    buf: Buffer
    worker: Buffer
    server: Buffer
    into: Buffer | None
    out: Any

    @classmethod
    def check(cls, topo: topology.Topology, x: Any, worker_error: Any, server_error: Any,
              out: Any, names: tuple[str, str, str, str]) -> _Part:
        """The arguments checked (each error names its argument: names) and wrapped."""
        buf = check_x(x, names[0])
        into = None if out is None else wrap(out, names[3])
        if into is not None and not into.staged and not buf.staged \
                and np.shares_memory(into.flat, buf.flat) \
                and into.flat.__array_interface__["data"] != buf.flat.__array_interface__["data"]:
            raise ValueError(f"{names[3]}: overlaps {names[0]} without being {names[0]}")
        padded, chunk = error_sizes(buf.flat.size, topo.size)
        return cls(buf, check_error(worker_error, names[1], padded),
                   check_error(server_error, names[2], chunk), into, out)


def _run(topo: topology.Topology, parts: list[_Part], block: int | None) -> list:
    """The engine's side of a host call: each part's average (float32, written straight
    into its destination where that is float32) and error buffers, written back where
    staged; the results, in order."""
    dests = [p.buf.empty(p.buf.shape) if p.into is None else p.into for p in parts]
    direct = [dest.dtype == "float32" for dest in dests]
    values = ONEBIT.grouped_allreduce(
        topo, [host_float(p.buf.flat, p.buf.dtype) for p in parts],
        [OnebitState(p.worker.flat, p.server.flat, block) for p in parts],
        [dest.flat if d else None for dest, d in zip(dests, direct)])
    results = []
    for p, dest, d, v in zip(parts, dests, direct, values):
        if not d:
            store_float(dest.flat, dest.dtype, v)
        p.worker.write_back()
        p.server.write_back()
        if p.into is None:
            results.append(dest.result())
        else:
            p.into.write_back()
            results.append(p.out)
    return results


def grouped_compressed_allreduce(xs: list, worker_errors: list, server_errors: list,
                                 block_size: int | None = None, *, outs: list | None = None,
                                 comm: Any = None) -> list:
    """compressed_allreduce of each xs[i] with worker_errors[i] and server_errors[i], in
    one call: one agreement, and across nodes with block scales on the host, the short
    vectors' packets sharing messages. Each result, and each error buffer's update, is
    the bits compressed_allreduce gives it alone. Device data is staged through the host.
    outs: None, or a list of the same length whose entries are None or what
    compressed_allreduce takes as out. Returns the list of results."""
    topo = topology.of(comm)
    with calls.Prepared(topo, "grouped_compressed_allreduce", None) as p:
        p.call, p.job = _prepare_grouped(topo, xs, worker_errors, server_errors, block_size,
                                         outs)
    return p.run()


def grouped_compressed_allreduce_async(xs: list, worker_errors: list, server_errors: list,
                                       block_size: int | None = None, *,
                                       outs: list | None = None, comm: Any = None) -> Handle:
    """grouped_compressed_allreduce queued on the engine: a Handle for synchronize(); the
    error buffers (and outs) must not be touched until it completes."""
    topo = topology.of(comm)
    with calls.Prepared(topo, "grouped_compressed_allreduce", None) as p:
        p.call, p.job = _prepare_grouped(topo, xs, worker_errors, server_errors, block_size,
                                         outs)
    return p.submit()


def _prepare_grouped(topo: topology.Topology, xs: Any, worker_errors: Any,
                     server_errors: Any, block_size: Any, outs: Any) -> tuple[calls.Call, Job]:
    lists = {"xs": xs, "worker_errors": worker_errors, "server_errors": server_errors}
    if outs is not None:
        lists["outs"] = outs
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name}: expected a list, got {type(value).__name__}")
        if len(value) != len(xs):
            raise ValueError(f"{name}: expected {len(xs)} entries (one per x), got "
                             f"{len(value)}")
    outs = [None] * len(xs) if outs is None else outs
    block = check_block(block_size)
    parts = []
    for i, (x, worker, server, out) in enumerate(zip(xs, worker_errors, server_errors, outs)):
        if out is not None:
            _check_out(out, x, f"outs[{i}]")
        parts.append(_Part.check(topo, x, worker, server, out, (
            f"xs[{i}]", f"worker_errors[{i}]", f"server_errors[{i}]", f"outs[{i}]")))
    fields = (("dtypes", tuple(p.buf.dtype for p in parts)),
              ("shapes", tuple(p.buf.shape for p in parts)), ("block_size", block))
    call = calls.describe(topo, "grouped_compressed_allreduce", fields, ONEBIT.name)
    return call, Job(lambda: _run(topo, parts, block))


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
