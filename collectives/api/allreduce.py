"""allreduce and grouped_allreduce, sync / in place / async, with scaling and compression:
the fast entry for a described host call, else the general path (describe, Job, engine)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from collectives import algorithms, kernels
from collectives.api import calls, on_device, process_sets
from collectives.api.base import (
    check_algorithm,
    check_list,
    check_reduction,
    compressed_into,
    one_dtype,
    scale,
    scale_factors,
)
from collectives.api.calls import Call, Prepared
from collectives.auto import online, select
from collectives.compression import Compression, check_compression
from collectives.dtypes import FLOATING, NUMPY_NAMES, STORAGE, loaded_torch, torch_dtype_name
from collectives.ops import ReduceOp, check_op
from collectives.runtime import faults, profiling, topology
from collectives.runtime.buffers import (
    POOL_MIN_BYTES,
    Buffer,
    host_empty,
    host_float,
    is_device_data,
    store_float,
    wrap,
)
from collectives.runtime.engine import Handle, Job

# ----------------------------------------------------------------------------- allreduce

#: allreduce's algorithms: the host ones, and `device` for device data (api/on_device.py).
ALLREDUCE_ALGORITHMS = (*algorithms.ALGORITHMS, on_device.NAME)


def _fast(topo: topology.Topology, x: Any, op: Any, algorithm: Any, inplace: bool) -> Any:
    """The allreduce fast entry: a host NumPy array or CPU torch tensor whose call was
    described before and has a C++ path (calls.Call.fast) goes straight to it. None: not
    taken (nor while a torch profiler records: the general path shows in it)."""
    if type(op) is not ReduceOp or profiling.on():
        return None
    if type(x) is np.ndarray:
        call = topo.state(calls.Calls).fast.get((op, x.dtype, x.shape, algorithm, inplace))
        if call is None:
            return None
        # a large result's memory comes from the result pool (no fresh pages to fault in)
        out = x if inplace else None if x.nbytes < POOL_MIN_BYTES else host_empty(x.shape,
                                                                                  x.dtype)
        try:
            return call.fast(x, out)
        except Exception as exc:
            faults.reraise(topo, exc)
    # a tensor goes in by address: its dtype and shape are the described call's, so only
    # where it lives and its layout are left to check
    torch = loaded_torch()
    if torch is None or type(x) is not torch.Tensor or not x.is_cpu or x.requires_grad and inplace \
            or x.layout is not torch.strided or not x.is_contiguous():
        return None
    call = topo.state(calls.Calls).fast.get((op, x.dtype, x.shape, algorithm, inplace))
    if call is None:
        return None
    if inplace:
        out = x
    elif x.numel() * x.element_size() < POOL_MIN_BYTES:
        out = torch.empty_like(x, requires_grad=False)
    else:
        out = torch.from_numpy(host_empty(x.shape, STORAGE[torch_dtype_name(x.dtype)]))
    try:
        return out if call.fast.at(x.data_ptr(), out.data_ptr()) else None
    except Exception as exc:
        faults.reraise(topo, exc)


def _allreduce(topo: topology.Topology, x: Any, op: Any, algorithm: Any, compression: Any,
               inplace: bool, prescale_factor: Any = 1.0,
               postscale_factor: Any = 1.0) -> tuple[Call, Job]:
    # the checks, where the argument is not already what they would return
    if type(op) is not ReduceOp:
        op = check_op(op)
    if algorithm not in ALLREDUCE_ALGORITHMS:
        check_algorithm(algorithm, ALLREDUCE_ALGORITHMS)
    compressor = Compression.none if compression is None else check_compression(compression)
    if algorithm == on_device.NAME or is_device_data(x):
        scaled = prescale_factor != 1 or postscale_factor != 1
        if on_device.takes(topo, x, algorithm, compressor is Compression.none and not scaled):
            return on_device.allreduce(topo, x, op, algorithm, inplace)
        if compressor is not Compression.none and not scaled and on_device.compressible(x):
            return on_device.compressed(topo, x, op, algorithm, compressor, inplace)
    buf = wrap(x, "x")  # type check now, in the caller's thread
    if prescale_factor != 1 or postscale_factor != 1:
        return _scaled(topo, buf, op, algorithm, compressor, inplace, prescale_factor,
                       postscale_factor)
    if compressor is not Compression.none and buf.dtype in FLOATING:
        return _compressed(topo, buf, op, algorithm, compressor, inplace)
    call = calls.allreduce(topo, buf.dtype, buf.shape, buf.nbytes, op, algorithm, inplace)
    out = buf if inplace else buf.empty(buf.shape)
    fast = call.fast is not None and not buf.staged and buf.dtype != "bfloat16"
    key = (op, x.dtype, x.shape, algorithm, inplace)
    checked = algorithm == "auto" and online.checks(topo, buf.nbytes)
    if fast and not checked:
        calls.take_fast(topo, key, call)  # the next such call takes the fast entry
    if call.rides:  # the data rides in the agreement
        return call, Job(lambda: buf.result_from(out), buf.flat, out.flat, buf.flat.size,
                         call.dtype_code, call.op_code, call.divisor)

    def reduce(algo: str) -> None:
        algorithms.reduce(algo, topo, buf.flat, out.flat, op, buf.dtype)

    def move() -> Any:
        if checked:  # `auto` picks the algorithm now (online.py)
            online.run(topo, call.size_class, buf.nbytes, inplace, reduce)
            if fast and online.settled_on(topo, call.size_class, buf.nbytes, inplace,
                                          call.algorithm, call.fast):
                calls.take_fast(topo, key, call)  # final: the next such call is fast
        else:
            reduce(call.algorithm)
        return buf.result_from(out)

    return call, Job(move)


def _scaled(topo: topology.Topology, buf: Buffer, op: ReduceOp, algorithm: str,
            compressor: Any, inplace: bool, prescale_factor: Any,
            postscale_factor: Any) -> tuple[Call, Job]:
    """An allreduce with scale factors: agreed like its other fields; x scaled on the way
    into the result buffer (no separate copy), the result scaled after the reduction."""
    scaling, pre, post = scale_factors(prescale_factor, postscale_factor)
    if compressor is not Compression.none and buf.dtype in FLOATING:
        return _compressed(topo, buf, op, algorithm, compressor, inplace, scaling, pre, post)
    fields = (("op", op.name), ("dtype", buf.dtype), ("shape", buf.shape),
              ("algorithm", algorithm), ("compression", "none")) + scaling
    algo = select.concrete(topo, "allreduce", algorithm, buf.nbytes)
    call = calls.reduction(topo, "allreduce", fields, buf.dtype, buf.nbytes, op, algo)
    out = buf if inplace else buf.empty(buf.shape)
    if pre != 1:
        scale(buf.flat, out.flat, buf.dtype, pre)
    send = out.flat if pre != 1 else buf.flat

    def finish() -> Any:
        if post != 1:
            scale(out.flat, out.flat, out.dtype, post)
        return buf.result_from(out)

    if call.rides:
        return call, Job(finish, send, out.flat, buf.flat.size, call.dtype_code, call.op_code,
                         call.divisor)

    def move() -> Any:
        algorithms.reduce(call.algorithm, topo, send, out.flat, op, buf.dtype)
        return finish()

    return call, Job(move)


def _compressed(topo: topology.Topology, buf: Buffer, op: ReduceOp, algorithm: str,
                compressor: Any, inplace: bool, scaling: tuple = (), pre: float = 1.0,
                post: float = 1.0) -> tuple[Call, Job]:
    """A floating allreduce under a compressor (compression.py), counted under its name."""
    compressor.check_op(op)
    compressor.check_count(buf.flat.size)
    fields = (("op", op.name), ("dtype", buf.dtype), ("shape", buf.shape),
              ("algorithm", algorithm), ("compression", compressor.name)) + scaling
    call = calls.describe(topo, "allreduce", fields, compressor.name)
    out = buf if inplace else buf.empty(buf.shape)

    def move() -> Any:
        compressed_into(out, buf, pre, post,
                        lambda values: compressor.allreduce(topo, values, op, algorithm))
        return buf.result_from(out)

    return call, Job(move)


def _prepared(topo: topology.Topology, name: str | None, collective: str,
              make: Callable[..., tuple[Call, Job]], *args: Any) -> Prepared:
    """The call make(topo, *args) describes (allreduce's or grouped_allreduce's), prepared
    in the public function's stead (calls.Prepared)."""
    with Prepared(topo, collective, name) as p:
        p.call, p.job = make(topo, *args)
    return p


def allreduce(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
              compression: Any = None, *, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None, comm: Any = None,
              process_set: Any = None) -> Any:
    """Reduce x over all ranks; a new array of x's type, dtype, shape and device.
    prescale_factor multiplies every rank's x before the reduction, postscale_factor the
    result (as Horovod's); name labels the call in mismatch and stall messages and the
    timeline (every rank must pass the same)."""
    # inline: the allreduce fast entry's path
    topo = topology.of(comm) if process_set is None else process_sets.resolve(comm, process_set)
    if compression is None and name is None and prescale_factor == 1 and postscale_factor == 1:
        out = _fast(topo, x, op, algorithm, False)
        if out is not None:
            return out
    return _prepared(topo, name, "allreduce", _allreduce, x, op, algorithm, compression, False,
                     prescale_factor, postscale_factor).run()


def allreduce_(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
               compression: Any = None, *, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, name: str | None = None, comm: Any = None,
               process_set: Any = None) -> Any:
    """Reduce x over all ranks in place; returns x."""
    # inline: the allreduce fast entry's path
    topo = topology.of(comm) if process_set is None else process_sets.resolve(comm, process_set)
    if compression is None and name is None and prescale_factor == 1 and postscale_factor == 1 \
            and _fast(topo, x, op, algorithm, True) is not None:
        return x
    return _prepared(topo, name, "allreduce", _allreduce, x, op, algorithm, compression, True,
                     prescale_factor, postscale_factor).run()


# --------------------------------------------------------------------- grouped allreduce

def _packable(flat: np.ndarray) -> np.ndarray:
    """A flat storage array as kernels.pack takes it: bfloat16's uint16 bits viewed as
    float16 (pack copies bits exactly at scale 1)."""
    return flat.view(np.float16) if flat.dtype == np.uint16 else flat


class _Group(NamedTuple):
    """A group of tensors packed into one flat storage array, and how to hand a reduced
    one back (as new tensors, or into the originals)."""

    dtype: str
    shapes: tuple
    packed: np.ndarray
    finish: Callable[[np.ndarray], list]


def _host_group(tensors: list, inplace: bool) -> _Group | None:
    """The group straight through the C++ pack and unpack (a fraction of a microsecond per
    tensor): contiguous host NumPy arrays, or contiguous CPU torch tensors. None otherwise."""
    first, torch = tensors[0], loaded_torch()
    if all(type(t) is np.ndarray and t.flags.c_contiguous for t in tensors):
        dtype, like = NUMPY_NAMES.get(first.dtype), np.empty_like
    elif torch is not None and all(type(t) is torch.Tensor and t.device.type == "cpu"
                                   and t.is_contiguous() for t in tensors):
        dtype, like = torch_dtype_name(first.dtype), torch.empty_like
    else:
        return None
    if dtype is None:
        return None  # wrap() names the unsupported dtype
    packed = wrap(kernels.pack(tensors), "tensors").flat  # checks every tensor's dtype
    outs = tensors if inplace else [like(t) for t in tensors]

    def finish(reduced: np.ndarray) -> list:
        buffer = reduced if like is np.empty_like else torch.from_numpy(_packable(reduced))
        kernels.unpack(buffer.view(torch.bfloat16) if dtype == "bfloat16" else buffer, outs)
        return list(outs)

    return _Group(dtype, tuple(tuple(t.shape) for t in tensors), packed, finish)


def _wrapped_group(tensors: list, inplace: bool) -> _Group:
    """The group through wrap(): any array type, staged where needed."""
    bufs = [wrap(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    dtype = one_dtype(bufs)
    packed = kernels.pack([_packable(b.flat) for b in bufs]) if bufs else np.empty(0)
    outs = bufs if inplace else [b.empty(b.shape) for b in bufs]

    def finish(reduced: np.ndarray) -> list:
        if outs:
            kernels.unpack(_packable(reduced), [_packable(o.flat) for o in outs])
        return [b.result_from(o) for b, o in zip(bufs, outs)]

    return _Group(dtype, tuple(b.shape for b in bufs), packed.view(STORAGE[dtype]), finish)


def _grouped_allreduce(topo: topology.Topology, tensors: Any, op: Any, algorithm: Any,
                       compression: Any, inplace: bool, prescale_factor: Any = 1.0,
                       postscale_factor: Any = 1.0) -> tuple[Call, Job]:
    op, scaling, pre, post = check_reduction(op, algorithm, prescale_factor, postscale_factor)
    compressor = check_compression(compression)
    check_list(tensors)
    group = tensors and _host_group(tensors, inplace) or _wrapped_group(tensors, inplace)
    dtype, packed = group.dtype, group.packed
    compressed = compressor is not Compression.none and dtype in FLOATING
    fields = (("op", op.name), ("dtype", dtype), ("shapes", group.shapes),
              ("algorithm", algorithm), ("compression", compressor.name)) + scaling
    if compressed:
        compressor.check_op(op)
        compressor.check_count(packed.size)
        call = calls.describe(topo, "grouped_allreduce", fields, compressor.name)
    else:
        algo = select.concrete(topo, "allreduce", algorithm, packed.nbytes)
        call = calls.reduction(topo, "grouped_allreduce", fields, dtype, packed.nbytes, op, algo)
    if pre != 1:  # packed is our own copy
        scale(packed, packed, dtype, pre)

    def finish(reduced: np.ndarray) -> list:
        if post != 1:
            scale(reduced, reduced, dtype, post)
        return group.finish(reduced)

    if call.rides:
        return call, Job(lambda: finish(packed), packed, packed, packed.size,
                         call.dtype_code, call.op_code, call.divisor)

    def move() -> list:
        if compressed:
            reduced = np.empty_like(packed)
            store_float(reduced, dtype,
                        compressor.allreduce(topo, host_float(packed, dtype), op, algorithm))
        else:
            reduced = packed
            algorithms.reduce(call.algorithm, topo, packed, reduced, op, dtype)
        return finish(reduced)

    return call, Job(move)


def grouped_allreduce(tensors: list, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
                      compression: Any = None, *, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: str | None = None,
                      comm: Any = None, process_set: Any = None) -> list:
    """allreduce of every tensor of the list in one call: one agreement and one fused
    message (the tensors packed by one C++ call). The tensors share one dtype and may differ
    in shape and type; returns a list of new arrays like them."""
    topo = process_sets.resolve(comm, process_set)
    return _prepared(topo, name, "grouped_allreduce", _grouped_allreduce, tensors, op,
                     algorithm, compression, False, prescale_factor, postscale_factor).run()


def grouped_allreduce_(tensors: list, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
                       compression: Any = None, *, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, name: str | None = None,
                       comm: Any = None, process_set: Any = None) -> list:
    """grouped_allreduce in place; returns the tensors."""
    topo = process_sets.resolve(comm, process_set)
    return _prepared(topo, name, "grouped_allreduce", _grouped_allreduce, tensors, op,
                     algorithm, compression, True, prescale_factor, postscale_factor).run()


# ------------------------------------------------------------------------ async variants

def _queued(sync: Callable[..., Any], make: Callable[..., tuple[Call, Job]],
            inplace: bool) -> Callable[..., Handle]:
    """sync's async variant: the same arguments (the data positional), its call queued on
    the engine behind everything submitted before; a Handle at once, whose
    synchronize(handle) is sync's result."""
    collective = sync.__name__.rstrip("_")

    def queued(data: Any, /, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
               compression: Any = None, *, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, name: str | None = None, comm: Any = None,
               process_set: Any = None) -> Handle:
        topo = process_sets.resolve(comm, process_set)
        return _prepared(topo, name, collective, make, data, op, algorithm, compression,
                         inplace, prescale_factor, postscale_factor).submit()

    queued.__name__ = queued.__qualname__ = f"{collective}_async{'_' if inplace else ''}"
    queued.__doc__ = f"{sync.__name__}, queued: a Handle at once (synchronize gives the result)."
    return queued


allreduce_async = _queued(allreduce, _allreduce, False)
allreduce_async_ = _queued(allreduce_, _allreduce, True)
grouped_allreduce_async = _queued(grouped_allreduce, _grouped_allreduce, False)
grouped_allreduce_async_ = _queued(grouped_allreduce_, _grouped_allreduce, True)
