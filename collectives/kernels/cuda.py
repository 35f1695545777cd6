"""CUDA face of the kernels (csrc/cuda/*.cu) for CuPy arrays and torch CUDA tensors.

collectives.kernels sends device memory here; semantics are those of the C++ kernels. The
.cu files are compiled at first use by CuPy (RawModule, NVRTC), so installing the package
needs no CUDA toolkit. torch tensors are viewed as CuPy arrays through DLPack (zero-copy),
the kernels run on torch's current stream, and results go back to torch the same way."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import cupy
import numpy as np

from collectives.dtypes import FLOATING, NAMES, NUMPY_NAMES, STORAGE, torch_dtype_name
from collectives.kernels.args import CUDA_SOURCES as SOURCES
from collectives.kernels.args import INT8_BLOCK_SIZE, block_length, check_count, like
from collectives.ops import ReduceOp

THREADS = 256  # per CTA; INT8_BLOCK and SUMSQ_THREADS in the .cu files are the same
MAX_BLOCKS = 65535  # kernels are grid-stride loops, so a capped grid still covers all
LIST_BLOCKS = 8192  # CTAs of one pack/unpack launch, shared among the tensors
SUMSQ_SEGMENT = 1 << 16  # elements per CTA of a long block's sum of squares

Array = Any


@functools.cache
def _module(name: str) -> cupy.RawModule:
    code = (SOURCES / f"{name}.cu").read_text()
    return cupy.RawModule(code=code, options=("--std=c++17", f"-I{SOURCES}"))


def _launch(module: str, kernel: str, work: int, args: tuple, grid_y: int = 1) -> None:
    if work > 0:
        blocks = min(-(-work // THREADS), MAX_BLOCKS)
        _module(module).get_function(kernel)((blocks, grid_y), (THREADS,), args)


def _is_torch(x: object) -> bool:
    return type(x).__module__.startswith("torch")


def _device(x: Array, name: str) -> tuple[cupy.ndarray, str]:
    """x as a C-contiguous CuPy array (no copy) and its dtype name (bfloat16 as uint16)."""
    if _is_torch(x):
        dtype = _torch_cuda_dtype(x, name)
        t = x.detach()
        if dtype == "bfloat16":  # CuPy has no bfloat16: move the bits as uint16
            t = t.view(sys.modules["torch"].int16)
        arr = cupy.from_dlpack(t)
        arr = arr.view(cupy.uint16) if dtype == "bfloat16" else arr
    elif isinstance(x, cupy.ndarray):
        arr, dtype = x, NUMPY_NAMES.get(x.dtype)
        if dtype is None:
            raise _unsupported(name, x.dtype.name)
    else:
        raise TypeError(f"{name}: expected a cupy.ndarray or torch CUDA tensor, got "
                        f"{type(x).__name__}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    return arr, dtype


def _torch_cuda_dtype(x: Any, name: str) -> str:
    """A torch tensor's dtype name; raises unless it lives on a CUDA device and its dtype is
    one we support."""
    if x.device.type != "cuda":
        raise TypeError(f"{name}: expected a CUDA tensor, got one on {x.device}")
    dtype = torch_dtype_name(x.dtype)
    if dtype is None:
        raise _unsupported(name, str(x.dtype).removeprefix("torch."))
    return dtype


def _unsupported(name: str, dtype: str) -> TypeError:
    return TypeError(f"{name}: unsupported dtype {dtype}; expected one of {list(NAMES)}")


def _typed(x: Array, name: str, dtype: str) -> cupy.ndarray:
    arr, got = _device(x, name)
    if got != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {got}")
    return arr.reshape(-1)


def _need(arr: cupy.ndarray, name: str, need: int) -> None:
    if arr.size < need:
        raise ValueError(f"{name}: holds {arr.size} elements, need {need}")


def _like(arr: cupy.ndarray, ref: Array, dtype: str | None = None) -> Array:
    """arr as the kind of ref: a torch tensor (zero-copy, DLPack) if ref is one."""
    return like(arr, ref, dtype, "from_dlpack")


@contextlib.contextmanager
def _context(ref: Array) -> Iterator[None]:
    """ref's device, and for torch data torch's current stream, so that our allocations
    and launches are ordered with torch's own work on that data (no races, no syncs)."""
    if ref is None:
        yield
    elif _is_torch(ref):
        stream = sys.modules["torch"].cuda.current_stream(ref.device).cuda_stream
        with cupy.cuda.Device(ref.device.index), cupy.cuda.ExternalStream(stream):
            yield
    else:
        with ref.device:
            yield


def _pointers(arrays: Sequence[cupy.ndarray]) -> cupy.ndarray:
    return cupy.asarray(np.array([a.data.ptr for a in arrays], np.uint64))


def storage(x: Array, name: str) -> tuple[cupy.ndarray, str]:
    """A C-contiguous CuPy array or torch CUDA tensor as a flat CuPy view of its storage (no
    copy; bfloat16 as uint16) and its dtype name."""
    arr, dtype = _device(x, name)
    return arr.reshape(-1), dtype


def device_of(x: Array) -> int:
    """The index of the CUDA device x lives on."""
    return x.device.index if _is_torch(x) else x.device.id


def stream_of(ref: Array) -> cupy.cuda.Stream:
    """The stream that orders the caller's work on ref: torch's current stream for a torch
    tensor, CuPy's current stream for a CuPy array (of this thread, on ref's device)."""
    if _is_torch(ref):
        torch_stream = sys.modules["torch"].cuda.current_stream(ref.device)
        return cupy.cuda.ExternalStream(torch_stream.cuda_stream, ref.device.index)
    with ref.device:
        return cupy.cuda.get_current_stream()


def recorded(stream: cupy.cuda.Stream) -> cupy.cuda.Event:
    """An event recorded now on stream: a stream that waits for it sees what was queued
    on stream so far done."""
    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    return event


# ---- reduce / divide --------------------------------------------------------------------

_OP_NAMES = {ReduceOp.Sum: "sum", ReduceOp.Min: "min", ReduceOp.Max: "max",
             ReduceOp.Product: "product"}
_FOLD = 4  # sources one reduce launch takes (csrc/cuda/reduce.cu)


def _storage(x: Array, name: str, dtype: str) -> cupy.ndarray:
    """x as a flat CuPy array of dtype's storage: a CuPy array of that storage type (uint16
    for bfloat16), or a torch CUDA tensor of dtype."""
    if not isinstance(x, cupy.ndarray):
        return _typed(x, name, dtype)
    if x.dtype != STORAGE[dtype]:
        raise TypeError(f"{name}: expected {STORAGE[dtype]} (the storage of {dtype}), got "
                        f"{x.dtype}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    return x.reshape(-1)


def reduce(dst: Array, srcs: Sequence[Array], dtype: str, op: ReduceOp) -> None:
    """kernels.reduce for device buffers. A launch folds up to four sources; a longer list
    goes on folding into dst, which is the same left fold (each op is rounded to dtype)."""
    if op not in _OP_NAMES:
        raise ValueError(f"op: expected one of {[o.name for o in _OP_NAMES]}, got {op!r}")
    if not srcs:
        raise ValueError("srcs: need at least one source buffer")
    with _context(dst):
        out = _storage(dst, "dst", dtype)
        ins = [_storage(s, f"srcs[{k}]", dtype) for k, s in enumerate(srcs)]
        for k, a in enumerate(ins):
            _need(a, f"srcs[{k}]", out.size)
        kernel = f"reduce_{dtype}_{_OP_NAMES[op]}"
        _fold(kernel, out, ins[:_FOLD])
        for lo in range(_FOLD, len(ins), _FOLD - 1):
            _fold(kernel, out, [out, *ins[lo:lo + _FOLD - 1]])


def _fold(kernel: str, out: cupy.ndarray, ins: list[cupy.ndarray]) -> None:
    unused = [ins[0]] * (_FOLD - len(ins))  # pointers the kernel never reads
    _launch("reduce", kernel, out.size,
            (out, *ins, *unused, np.int32(len(ins)), np.int64(out.size)))


def divide(buf: Array, dtype: str, divisor: int) -> None:
    """kernels.divide for device buffers."""
    if divisor == 0:
        raise ValueError("divisor: must be non-zero")
    with _context(buf):
        flat = _storage(buf, "buf", dtype)
        _launch("reduce", f"divide_{dtype}", flat.size,
                (flat, np.int64(flat.size), np.int64(divisor)))


# ---- pack / unpack ----------------------------------------------------------------------

class _List(NamedTuple):
    """A tensor list as the pack/unpack kernels take it: where each tensor lives and where it
    starts in the packed buffer, in one device array (one host-to-device copy per launch)."""
    table: cupy.ndarray  # int64: n pointers, then n + 1 offsets (the total last)
    n: int
    total: int
    largest: int
    dtype: str

    @property
    def pointers(self) -> cupy.ndarray:
        return self.table[:self.n]

    @property
    def offsets(self) -> cupy.ndarray:
        return self.table[self.n:]


def _tensor_list(tensors: Sequence[Array], dtype: str | None) -> _List:
    """The list's table, checking each tensor (CUDA, contiguous, one dtype). torch tensors
    are read through their own attributes, not DLPack: a DLPack view is an object made per
    tensor, and for a bucket of many small gradients those would cost many times the pack."""
    n = len(tensors)
    host = np.zeros(2 * n + 1, np.int64)
    for i, t in enumerate(tensors):
        name = f"tensors[{i}]"
        if _is_torch(t):
            got = _torch_cuda_dtype(t, name)
            if not t.is_contiguous():
                raise ValueError(f"{name}: must be C-contiguous")
            host[i], size = t.data_ptr(), t.numel()
        else:
            arr, got = _device(t, name)
            host[i], size = arr.data.ptr, arr.size
        dtype = dtype or got
        if got != dtype:
            raise TypeError(f"{name}: dtype {got} differs from {dtype}")
        host[n + i + 1] = host[n + i] + size
    sizes = np.diff(host[n:])
    return _List(cupy.asarray(host), n, int(host[-1]), int(sizes.max(initial=0)),
                 dtype or "float32")


def _pack_kernel(direction: str, dtype: str, scale: float) -> tuple[str, tuple]:
    """Kernel name and trailing scale argument for pack/unpack of dtype by scale."""
    if scale == 1.0:
        return f"{direction}_copy{STORAGE[dtype].itemsize}", ()
    if dtype not in FLOATING:
        raise ValueError(f"scale: must be 1 for {dtype} tensors, got {scale}")
    return f"{direction}_{dtype}", ((np.float64 if dtype == "float64" else np.float32)(scale),)


def _launch_list(kernel: str, tensors: _List, args: tuple) -> None:
    """One pack/unpack launch: blockIdx.y per tensor, a few CTAs along each tensor."""
    if tensors.largest:
        ny = min(tensors.n, MAX_BLOCKS)
        nx = min(-(-tensors.largest // THREADS), max(1, LIST_BLOCKS // ny))
        _module("pack").get_function(kernel)((nx, ny), (THREADS,), args)


def pack(tensors: Sequence[Array], out: Array | None, scale: float) -> Array:
    """kernels.pack for device tensors: one launch for the whole list."""
    ref = tensors[0] if tensors else out
    with _context(ref):
        out_dtype = _device(out, "out")[1] if out is not None else None
        tlist = _tensor_list(tensors, out_dtype)
        dtype, total = tlist.dtype, tlist.total
        if out is None:
            flat = cupy.empty(total, STORAGE[dtype])
            out = _like(flat, ref, dtype) if ref is not None else flat
        else:
            flat = _typed(out, "out", dtype)
            _need(flat, "out", total)
        kernel, extra = _pack_kernel("pack", dtype, scale)
        _launch_list(kernel, tlist,
                     (tlist.pointers, tlist.offsets, np.int32(tlist.n), flat) + extra)
    return out.reshape(-1)[:total]


def unpack(buffer: Array, tensors: Sequence[Array], scale: float) -> None:
    """kernels.unpack for device tensors: one launch for the whole list."""
    with _context(buffer):
        flat, dtype = _device(buffer, "buffer")
        tlist = _tensor_list(tensors, dtype)
        _need(flat.reshape(-1), "buffer", tlist.total)
        kernel, extra = _pack_kernel("unpack", tlist.dtype, scale)
        _launch_list(kernel, tlist,
                     (flat, tlist.pointers, tlist.offsets, np.int32(tlist.n)) + extra)


# ---- fp16 / int8 ------------------------------------------------------------------------

def _convert(x: Array, name: str, src_dtype: str, out_dtype: str, kernel: str) -> Array:
    """x (src_dtype) converted elementwise to a new out_dtype array of x's shape and kind."""
    with _context(x):
        src = _typed(x, name, src_dtype)
        out = cupy.empty(src.size, out_dtype)
        _launch("quantize", kernel, src.size, (src, out, np.int64(src.size)))
        return _like(out.reshape(tuple(x.shape)), x)


def quantize_fp16(x: Array) -> Array:
    return _convert(x, "x", "float32", "float16", "quantize_fp16")


def dequantize_fp16(h: Array) -> Array:
    return _convert(h, "h", "float16", "float32", "dequantize_fp16")


def quantize_int8(x: Array) -> tuple[Array, Array]:
    with _context(x):
        src = _typed(x, "x", "float32")
        q = cupy.empty(src.size, cupy.int8)
        scales = cupy.empty(-(-src.size // INT8_BLOCK_SIZE), cupy.float32)
        # one CTA of THREADS == INT8_BLOCK_SIZE threads per block
        _launch("quantize", "quantize_int8", src.size, (src, q, scales, np.int64(src.size)))
        return _like(q, x), _like(scales, x)


def dequantize_int8(q: Array, scales: Array, count: int) -> Array:
    count = check_count(count)
    with _context(q):
        qs, sc = _typed(q, "q", "int8"), _typed(scales, "scales", "float32")
        _need(qs, "q", count)
        _need(sc, "scales", -(-count // INT8_BLOCK_SIZE))
        out = cupy.empty(count, cupy.float32)
        _launch("quantize", "dequantize_int8", count, (qs, sc, out, np.int64(count)))
        return _like(out, q)


# ---- 1-bit ------------------------------------------------------------------------------

def _scales(scales: Array | float, name: str, need: int) -> cupy.ndarray:
    if isinstance(scales, (float, int, np.floating)) and not isinstance(scales, bool):
        arr = cupy.full(1, scales, cupy.float32)
    else:
        arr = _typed(scales, name, "float32")
    _need(arr, name, need)
    return arr


def onebit_compress(x: Array, error: Array, block_size: int | None) -> tuple[Array, Array]:
    with _context(x):
        xs, es = _typed(x, "x", "float32"), _typed(error, "error", "float32")
        if es.size != xs.size:
            raise ValueError(f"error: has {es.size} elements, x has {xs.size}")
        count = xs.size
        block = min(block_length(block_size, count), max(count, 1))
        nblocks = -(-count // block)
        bits = cupy.empty((count + 7) // 8, cupy.uint8)
        scales = cupy.zeros(max(nblocks, 1 if block_size is None else 0), cupy.float32)
        _compress(xs, es, bits, scales, block)
        scale = _like(scales, x)
        return _like(bits, x), scale[0] if block_size is None else scale


def _compress(x: cupy.ndarray, error: cupy.ndarray, bits: cupy.ndarray, scales: cupy.ndarray,
              block: int) -> None:
    """The three launches of 1-bit compression (csrc/cuda/onebit.cu)."""
    count = x.size
    nblocks = -(-count // block)
    seg = min(block, SUMSQ_SEGMENT)
    per_block = -(-block // seg)
    pieces = nblocks * per_block
    partial = cupy.empty(pieces, cupy.float64)
    n, b = np.int64(count), np.int64(block)
    if pieces:  # one CTA per piece, not per element
        _module("onebit").get_function("onebit_partial_sumsq")(
            (min(pieces, MAX_BLOCKS),), (THREADS,),
            (x, error, n, b, np.int64(seg), np.int64(per_block), np.int64(pieces), partial))
    _launch("onebit", "onebit_scales", nblocks,
            (partial, np.int64(per_block), n, b, np.int64(nblocks), scales))
    _launch("onebit", "onebit_pack", bits.size, (x, error, bits, scales, n, b))


def onebit_decompress(bits: Array, scales: Array | float, count: int,
                      block_size: int | None) -> Array:
    count = check_count(count)
    block = block_length(block_size, count)
    with _context(bits):
        bs = _typed(bits, "bits", "uint8")
        _need(bs, "bits", (count + 7) // 8)
        sc = _scales(scales, "scales", -(-count // block))
        out = cupy.empty(count, cupy.float32)
        _launch("onebit", "onebit_decompress", count,
                (bs, sc, out, np.int64(count), np.int64(block)))
        return _like(out, bits)


def onebit_accumulate(acc: Array, bits: Sequence[Array], scales: Sequence[Array | float],
                      count: int, block_size: int | None) -> None:
    count = check_count(count)
    block = block_length(block_size, count)
    if len(bits) != len(scales):
        raise ValueError(f"scales: got {len(scales)} for {len(bits)} bits arrays")
    with _context(acc):
        dst = _typed(acc, "acc", "float32")
        _need(dst, "acc", count)
        bs = [_typed(b, f"bits[{k}]", "uint8") for k, b in enumerate(bits)]
        for k, b in enumerate(bs):
            _need(b, f"bits[{k}]", (count + 7) // 8)
        sc = [_scales(s, f"scales[{k}]", -(-count // block)) for k, s in enumerate(scales)]
        _launch("onebit", "onebit_accumulate", count,
                (dst, _pointers(bs), _pointers(sc), np.int32(len(bs)), np.int64(count),
                 np.int64(block)))
