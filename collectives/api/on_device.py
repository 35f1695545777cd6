"""Allreduces of device data that keep it on the device: which calls do, their agreed
fields, and the jobs that run them.

Uncompressed (algorithms/device.py): a torch CUDA tensor or CuPy array takes it under
algorithm="device", and under "auto" where the communicator is one node, CUDA IPC works
there (its first failure, seen by every rank alike, sends this and later `auto` calls
through the host instead) and its price is below the staged call's (device.cost,
device.staged_cost: every rank computes the same). The call's fields say ("memory",
"device"): a rank passing host data to the same call gets a MismatchError, like any
disagreement. Compressed (compressed(), onebit()): the compressor's kernels run on the
device and only what travels is staged, with the fields and bits of the host call. Scale
factors keep the staged path.

Ordering with the caller's work, as for a kernel of the caller's: the algorithm's stream
waits for an event recorded on the caller's stream (torch's or CuPy's current stream) when
the call is made, and the caller's stream waits for the result's event. When the call
returns (or its handle completes), x has been read, and work the caller queues on its stream
sees the result; another stream or the host must synchronize first, as after any kernel."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from collectives import algorithms
from collectives.algorithms.onebit import error_sizes
from collectives.api import calls
from collectives.api.calls import Call
from collectives.auto import select
from collectives.compression import Compressor
from collectives.compression.onebit import ONEBIT, OnebitState, check_block
from collectives.ops import ReduceOp
from collectives.runtime.buffers import is_device_data, wrap
from collectives.runtime.engine import Job, contributors
from collectives.runtime.ipc import IpcError
from collectives.runtime.topology import Topology

NAME = "device"  # algorithms/device.py's NAME (that module imports CuPy: device data only)
#: The dtypes compressed on the device (float64 is staged: CuPy's float64 -> float16 cast
#: is not NumPy's).
COMPRESSED_DTYPES = ("float32", "float16", "bfloat16")


def takes(topo: Topology, x: Any, algorithm: str, plain: bool) -> bool:
    """Whether this allreduce runs on the device (x is device data, or algorithm="device").
    plain: no compression or scale factors. Raises ValueError where algorithm="device"
    cannot run this call."""
    if algorithm != NAME:
        if algorithm != "auto" or not plain or not is_device_data(x):
            return False
        try:
            from collectives.algorithms import device
        except ImportError:  # no CuPy: the data goes through the host
            return False
        if not device.usable(topo):
            return False
        nbytes = x.numel() * x.element_size() if hasattr(x, "numel") else x.nbytes
        share = device.sharing(topo)
        host_s = min(select.estimates("allreduce", nbytes, topo).values())
        return device.cost(nbytes, topo.size, share) <= device.staged_cost(nbytes, share,
                                                                           host_s)
    if not is_device_data(x):
        raise ValueError(f"algorithm: {NAME!r} reduces device memory (a torch CUDA tensor or "
                         f"a CuPy array); x is a {type(x).__module__}.{type(x).__name__} "
                         f"on the host")
    if not plain:
        raise ValueError(f"algorithm: {NAME!r} takes no compression or scale factors; pass "
                         f"algorithm='auto' for those")
    try:
        from collectives.algorithms import device
    except ImportError as exc:
        raise ValueError(f"algorithm: {NAME!r} needs CuPy (its kernels run through it): "
                         f"{exc}") from exc
    device.check(topo)
    return True


def allreduce_fields(op: ReduceOp, dtype: str, shape: tuple, algorithm: str,
                     inplace: bool) -> tuple:
    """The agreed fields of a device allreduce: the host call's, then ("memory", "device"),
    so that a rank passing host data where the others pass device data is told `memory`."""
    return calls.allreduce_fields(op, dtype, shape, algorithm, inplace) + (("memory", "device"),)

def allreduce(topo: Topology, x: Any, op: ReduceOp, algorithm: str,
              inplace: bool) -> tuple[Call, Job]:
    """The description and job of a device allreduce of x (takes() said yes)."""
    from collectives.algorithms import device
    from collectives.kernels import cuda as cuda_kernels

    data = x.detach() if hasattr(x, "detach") else x
    contiguous = data.is_contiguous() if hasattr(data, "is_contiguous") \
        else data.flags.c_contiguous
    src = data if contiguous else (data.contiguous() if hasattr(data, "contiguous")
                                   else data.copy())
    send, dtype = cuda_kernels.storage(src, "x")
    ws = device.workspaces(topo, cuda_kernels.device_of(src))
    out = data if inplace and contiguous else (
        src if inplace else _empty_like(src))
    recv = send if out is src else cuda_kernels.storage(out, "out")[0]
    fields = allreduce_fields(op, dtype, tuple(x.shape), algorithm, inplace)
    call = calls.describe(topo, "allreduce", fields, NAME)
    caller = cuda_kernels.stream_of(src)
    ready = cuda_kernels.recorded(caller)

    def move() -> Any:
        if send.size:
            try:
                done = device.allreduce(topo, ws, send, recv, op, dtype,
                                        contributors(topo.size), ready)
            except IpcError:
                if algorithm != "auto":
                    raise
                return _staged(topo, x, op, inplace)
            caller.wait_event(done)  # the caller's later work on the result comes after it
            if inplace and out is not data:
                done.synchronize()  # the copy below runs on this thread's stream
                _copy_into(data, out)
        return x if inplace else out

    return call, Job(move)


def compressible(x: Any) -> bool:
    """Whether a compressed allreduce of x runs its compression on the device: device data
    of a dtype in COMPRESSED_DTYPES, with CuPy installed."""
    if not is_device_data(x):
        return False
    try:
        from collectives.kernels import cuda  # noqa: F401  (CuPy runs the kernels)
    except ImportError:
        return False
    return _dtype(x) in COMPRESSED_DTYPES


def compressed(topo: Topology, x: Any, op: ReduceOp, algorithm: str, compressor: Compressor,
               inplace: bool) -> tuple[Call, Job]:
    """An allreduce of device data under fp16 or int8 compression (compressible(x)): the
    compressor's kernels run on the device and only what travels is staged; the call and
    its bits are those of the same call on host data (its fields are the same)."""
    compressor.check_op(op)
    compressor.check_count(x.numel() if hasattr(x, "numel") else x.size)
    fields = (("op", op.name), ("dtype", _dtype(x)), ("shape", tuple(x.shape)),
              ("algorithm", algorithm), ("compression", compressor.name))
    call = calls.describe(topo, "allreduce", fields, compressor.name)
    values, on_callers_stream = _floats(x), _callers_stream(x)

    def move() -> Any:
        with on_callers_stream():
            result = _result(compressor.allreduce(topo, values, op, algorithm), x)
            if not inplace:
                return result
            _copy_into(x.detach() if hasattr(x, "detach") else x, result)
            return x

    return call, Job(move)


def onebit(topo: Topology, x: Any, worker_error: Any, server_error: Any,
           block_size: Any, out: Any = None) -> tuple[Call, Job]:
    """compressed_allreduce of device data with device error buffers: compression, the
    server step and decompression on the device (compression/onebit.py), only the packets
    staged; the error buffers are updated in place where they are. out (checked by the
    caller): the result is copied into it, on the caller's stream."""
    from collectives.kernels import cuda as cuda_kernels

    dtype = _dtype(x)
    if dtype not in COMPRESSED_DTYPES:
        raise TypeError(f"x: expected a floating dtype {list(COMPRESSED_DTYPES)} in device "
                        f"memory, got {dtype}")
    block = check_block(block_size)
    padded, chunk = error_sizes(_count(x), topo.size)
    device = cuda_kernels.device_of(x)
    worker = _error_buffer(worker_error, "worker_error", padded, device)
    server = _error_buffer(server_error, "server_error", chunk, device)
    fields = (("dtype", dtype), ("shape", tuple(x.shape)), ("block_size", block))
    call = calls.describe(topo, "compressed_allreduce", fields, ONEBIT.name)
    values, on_callers_stream = _floats(x), _callers_stream(x)
    state = OnebitState(worker, server, block)

    def move() -> Any:
        with on_callers_stream():
            result = _result(ONEBIT.allreduce(topo, values, ReduceOp.Average, "auto", state), x)
            if out is None:
                return result
            if hasattr(out, "detach"):
                out.detach().copy_(result)
            else:
                out[...] = result
            return out

    return call, Job(move)


def contribute(topo: Topology, op: ReduceOp, dtype: str, identity: Any) -> None:
    """A joined rank's part of a device allreduce (api/join.py): the same schedule, from
    identity (host storage of op's identity) copied to the device, its result dropped."""
    import cupy

    from collectives.algorithms import device

    if not identity.size:
        return
    current = device.current_device(topo)
    ws = device.workspaces(topo, cupy.cuda.runtime.getDevice() if current is None else current)
    with cupy.cuda.Device(ws.device):
        data = cupy.asarray(identity)
        cupy.cuda.get_current_stream().synchronize()
        try:
            device.allreduce(topo, ws, data, data, op, dtype, contributors(topo.size),
                             None).synchronize()
        except IpcError:
            algorithms.reduce(select.concrete(topo, "allreduce", "auto", identity.nbytes), topo,
                              identity, identity, op, dtype)


def _staged(topo: Topology, x: Any, op: ReduceOp, inplace: bool) -> Any:
    """The call through host memory: `auto`'s way where CUDA IPC failed (on every rank)."""
    buf = wrap(x, "x")
    out = buf if inplace else buf.empty(buf.shape)
    algo = select.concrete(topo, "allreduce", "auto", buf.nbytes)
    algorithms.reduce(algo, topo, buf.flat, out.flat, op, buf.dtype)
    return buf.result_from(out)


def _dtype(x: Any) -> str:
    """x's dtype name (TypeError naming x where we have none)."""
    from collectives.dtypes import NUMPY_NAMES, torch_dtype_name

    name = torch_dtype_name(x.dtype) if hasattr(x, "detach") else NUMPY_NAMES.get(x.dtype)
    if name is None:
        raise TypeError(f"x: unsupported dtype {x.dtype}")
    return name


def _count(x: Any) -> int:
    return x.numel() if hasattr(x, "numel") else x.size


def _floats(x: Any) -> Any:
    """x's values as a flat CuPy array on its device, made on the caller's stream: float16
    as it is, float32 as it is (a view where x is contiguous), bfloat16 widened to float32
    (exact), as the host path's values (buffers.host_float)."""
    from collectives.kernels import cuda as cuda_kernels

    if hasattr(x, "detach"):
        t = x.detach().reshape(-1)
        t = (t.float() if _dtype(x) == "bfloat16" else t).contiguous()
        return cuda_kernels.storage(t, "x")[0]
    return x.reshape(-1)


def _result(values: Any, x: Any) -> Any:
    """A new array of x's kind, dtype, shape and device holding values (a flat CuPy array),
    rounded to x's dtype to nearest even where it is narrower."""
    if hasattr(x, "detach"):
        import torch

        return torch.from_dlpack(values).to(x.dtype).reshape(x.shape)
    return values.astype(x.dtype, copy=False).reshape(x.shape)


def _error_buffer(error: Any, name: str, expected: int, device: int) -> Any:
    """A device error buffer as a flat CuPy view (updated in place), checked as on the host:
    float32, 1-D, expected elements; and contiguous, on x's device."""
    from collectives.kernels import cuda as cuda_kernels

    if not is_device_data(error):
        raise TypeError(f"{name}: expected device memory like x, got "
                        f"{type(error).__module__}.{type(error).__name__}")
    if _dtype(error) != "float32":
        raise TypeError(f"{name}: expected float32, got {_dtype(error)}")
    if len(error.shape) != 1 or error.shape[0] != expected:
        raise ValueError(f"{name}: expected a 1-D array of {expected} elements, got shape "
                         f"{tuple(error.shape)} (see collectives.algorithms.onebit.error_sizes)")
    if cuda_kernels.device_of(error) != device:
        raise ValueError(f"{name}: on CUDA device {cuda_kernels.device_of(error)}, x on "
                         f"{device}")
    return cuda_kernels.storage(error, name)[0]


def _callers_stream(x: Any) -> Callable[[], Any]:
    """A context, to enter on any thread, in which CuPy's and torch's work on x's device go
    to the stream the caller's work on x is on now (ordered after it, and before what the
    caller queues there next)."""
    import cupy

    if hasattr(x, "detach"):
        import torch

        stream = torch.cuda.current_stream(x.device)

        def context() -> Any:
            stack = contextlib.ExitStack()
            stack.enter_context(torch.cuda.stream(stream))
            stack.enter_context(cupy.cuda.Device(x.device.index))
            stack.enter_context(cupy.cuda.ExternalStream(stream.cuda_stream, x.device.index))
            return stack
        return context
    current = cupy.cuda.get_current_stream(x.device.id)

    def context() -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(cupy.cuda.Device(x.device.id))
        stack.enter_context(current)
        return stack
    return context


def _empty_like(x: Any) -> Any:
    """A new C-contiguous array of x's kind, dtype, shape and device."""
    if hasattr(x, "new_empty"):
        return x.new_empty(x.shape)
    import cupy

    with x.device:
        return cupy.empty(x.shape, x.dtype)


def _copy_into(dst: Any, src: Any) -> None:
    """dst[...] = src, an in-place call's result into the caller's array, on this thread's
    current stream (src is complete there: see the callers)."""
    if hasattr(dst, "copy_"):
        dst.copy_(src)
    else:
        dst[...] = src
