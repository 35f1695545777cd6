"""Python face of the C++ kernels (collectives._C) on host buffers.

Buffers are 1-D C-contiguous NumPy arrays; half types travel as 2-byte storage (NumPy
float16, or uint16 holding bfloat16 bits) and the dtype name says how to read them.

The kernels layer: kernels/__init__.py (host -> _C), cuda.py (device -> the CUDA kernels,
through CuPy), args.py (the argument rules both share).
May import: the leaves (config, dtypes, ops) and collectives._C."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from collectives.dtypes import CODES, NAMES, NUMPY_NAMES, STORAGE, torch_dtype_name
from collectives.kernels.args import (
    INT4_BLOCK_SIZE,
    INT8_BLOCK_SIZE,
    block_length,
    check_count,
    like,
    nblocks,
)
from collectives.ops import ReduceOp

try:
    from collectives import _C
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "collectives._C (the C++ kernels) is not built. Install the package with "
        "`pip install -e .` (or `make install`) from the repository root."
    ) from exc

Array = Any  # numpy.ndarray, torch.Tensor, or (on a GPU) cupy.ndarray


def reduce(dst: Array, srcs: Sequence[Array], dtype: str, op: ReduceOp) -> None:
    """dst = srcs[0] op srcs[1] op ... elementwise (dst may be srcs[0]); op is not Average.

    Buffers hold dtype's storage (dtypes.STORAGE): host NumPy arrays, or CuPy arrays / torch
    CUDA tensors for the CUDA kernels."""
    if type(dst) is not np.ndarray and _on_device(dst):
        return _cuda().reduce(dst, srcs, dtype, op)
    _C.reduce(dst, list(srcs), dst.size, CODES[dtype], int(op))


def shm_window(addresses: list[int], rank: int, header_bytes: int, stride: int,
               slot_bytes: int, depth: int, spin_seconds: float, stall_seconds: float,
               pids: list[int], limit: Any = None) -> Any:
    """A shared window's layout for the C++ stages below (csrc/runtime/shm.h); pids, one
    per rank (or none), make a long wait check that the rank it waits for is alive; limit
    (a _C.StallLimit, or None), where given, is read in place of stall_seconds as each wait
    starts."""
    return _C.ShmWindow(addresses, rank, header_bytes, stride, slot_bytes, depth, spin_seconds,
                        stall_seconds, pids, limit)


def shm_reduce(window: Any, send: np.ndarray, recv: np.ndarray, bounds: list[int],
               e: int, nchunks: int, dtype: str, op: ReduceOp, allreduce: bool,
               divisor: int = 1) -> None:
    """The shared-memory reduction stages of collectives/algorithms/shm.py; divisor > 1
    divides each reduced piece (an Average) in the stage that reduces it."""
    _C.shm_reduce(window, send, recv, bounds, e, nchunks, CODES[dtype], int(op),
                  allreduce, divisor)


def shm_reduce_single(window: Any, send: np.ndarray, recv: np.ndarray, lo: int, hi: int,
                      dtype: str, op: ReduceOp) -> None:
    """The single-step shared-memory reduction of collectives/algorithms/shm.py: recv =
    elements [lo, hi) of the reduction of every rank's send."""
    _C.shm_reduce_single(window, send, recv, send.size, lo, hi, CODES[dtype], int(op))


def shm_allgather_single(window: Any, send: np.ndarray, recv: np.ndarray,
                         bounds: list[int]) -> None:
    """The single-step shared-memory allgather of collectives/algorithms/shm.py."""
    _C.shm_allgather_single(window, send, recv, bounds, send.itemsize)


def shm_allgather(window: Any, send: np.ndarray, recv: np.ndarray, bounds: list[int], e: int,
                  nchunks: int) -> None:
    """The shared-memory allgather stages of collectives/algorithms/shm.py."""
    _C.shm_allgather(window, send, recv, bounds, e, nchunks, send.itemsize)


def shm_broadcast(window: Any, buf: np.ndarray, e: int, nchunks: int, root: int) -> None:
    """The shared-memory broadcast stages of collectives/algorithms/shm.py (buf as bytes)."""
    _C.shm_broadcast(window, buf, buf.nbytes, e, nchunks, root)


def divide(buf: Array, dtype: str, divisor: int) -> None:
    """buf /= divisor in place; floor division for integer dtypes (buf as in reduce)."""
    if type(buf) is not np.ndarray and _on_device(buf):
        return _cuda().divide(buf, dtype, divisor)
    _C.divide(buf, buf.size, CODES[dtype], divisor)


# ---- fusion packing, quantization, 1-bit compression ------------------------------------
# Host buffers (NumPy arrays, torch CPU tensors) go to _C with the GIL released; CuPy arrays
# and torch CUDA tensors go to the CUDA kernels (kernels/cuda.py). Results have the input's
# kind: NumPy in, NumPy out; torch in, torch out (same memory, no copies).


def _is_torch(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "device")


def _on_device(x: object) -> bool:
    """True for CuPy arrays and torch CUDA tensors: those take the CUDA kernels."""
    if type(x).__module__.startswith("cupy"):
        return True
    return _is_torch(x) and x.device.type == "cuda"


def _cuda():
    from collectives.kernels import (
        cuda as cuda_kernels,  # imports CuPy: only when device memory is actually used
    )

    return cuda_kernels


def _host(x: Array, name: str) -> tuple[np.ndarray, str]:
    """x as a NumPy view of its storage (bfloat16 as uint16 bits) and its dtype name."""
    if isinstance(x, np.ndarray):
        dtype = NUMPY_NAMES.get(x.dtype)
        if dtype is None:
            _unsupported(x.dtype.name, name)
        return x, dtype
    if _is_torch(x):
        if x.device.type != "cpu":
            raise TypeError(f"{name}: tensors on {x.device} are not supported")
        dtype = torch_dtype_name(x.dtype)
        if dtype is None:
            _unsupported(str(x.dtype).removeprefix("torch."), name)
        t = x.detach()
        if dtype == "bfloat16":
            return t.view(sys.modules["torch"].int16).numpy().view(np.uint16), dtype
        return t.numpy(), dtype
    raise TypeError(f"{name}: expected a numpy.ndarray or torch.Tensor, got {type(x).__name__}")


def _unsupported(shown: str, name: str) -> None:
    """TypeError naming argument `name` and its dtype `shown` (named only here: a NumPy
    dtype's name takes microseconds, which a call of many small tensors pays per tensor)."""
    raise TypeError(f"{name}: unsupported dtype {shown}; expected one of {list(NAMES)}")


def _host_f32(x: Array, name: str) -> np.ndarray:
    arr, dtype = _host(x, name)
    if dtype != "float32":
        raise TypeError(f"{name}: expected float32, got {dtype}")
    return arr


def _like(arr: np.ndarray, ref: Array, dtype: str | None = None) -> Array:
    """arr as the kind of ref (torch if ref is a torch tensor), sharing memory."""
    return like(arr, ref, dtype, "from_numpy")


def advise_huge_pages(x: Array) -> None:
    """Ask the kernel to back x's host memory with 2 MiB pages (the whole ones inside it),
    as the result pool does for its blocks: fresh memory then faults 512x fewer pages on
    first touch. A hint: nothing changes where the kernel has none to give; device memory
    is left alone."""
    if _on_device(x):
        return
    if _is_torch(x):
        _C.advise_huge_pages(x.data_ptr(), x.numel() * x.element_size())
    else:
        _C.advise_huge_pages(x.ctypes.data, x.nbytes)


def pack(tensors: Sequence[Array], out: Array | None = None, scale: float = 1.0) -> Array:
    """concat(t.ravel() for t in tensors) * scale in ONE kernel call: the fusion buffer.

    tensors are all NumPy arrays or all torch tensors, of one dtype (any in dtypes.NAMES; scale
    != 1 only for floating dtypes). out, if given, must hold at least the total element
    count; the filled prefix of out (flattened) is returned. Otherwise a new 1-D buffer of
    the tensors' kind is."""
    tensors = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
    first = tensors[0] if tensors else out
    if (first is not None and _on_device(first)) or (out is not None and _on_device(out)):
        return _cuda().pack(tensors, out, scale)
    dtype, torch_dtype = _list_dtype(tensors, out)
    if out is None:
        total = sum(t.numel() if torch_dtype else t.size for t in tensors)
        flat = np.empty(total, STORAGE[dtype])
        out = _like(flat, first, dtype) if torch_dtype else flat
    else:
        flat = _host_as(out, "out", dtype)
    total = _C.pack(flat, tensors, CODES[dtype], torch_dtype, float(scale))
    return out.reshape(-1)[:total]


def unpack(buffer: Array, tensors: Sequence[Array], scale: float = 1.0) -> None:
    """The inverse of pack: each tensor, in place, = its slice of buffer * scale."""
    tensors = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
    if _on_device(buffer) or (tensors and _on_device(tensors[0])):
        return _cuda().unpack(buffer, tensors, scale)
    dtype, torch_dtype = _list_dtype(tensors, buffer)
    flat = _host_as(buffer, "buffer", dtype)
    _C.unpack(flat, tensors, CODES[dtype], torch_dtype, float(scale))


def _list_dtype(tensors: Sequence[Array], other: Array | None) -> tuple[str, Any]:
    """The dtype name of a tensor list (tensors[0]'s; other's or float32 when empty), and
    tensors[0]'s torch.dtype for torch lists (None for NumPy): _C checks every tensor."""
    if not tensors:
        return ("float32" if other is None else _host(other, "out")[1]), None
    dtype = _host(tensors[0], "tensors[0]")[1]
    return dtype, (tensors[0].dtype if _is_torch(tensors[0]) else None)


def _host_as(x: Array, name: str, dtype: str) -> np.ndarray:
    arr, got = _host(x, name)
    if got != dtype:
        raise TypeError(f"{name}: dtype {got} differs from the tensors' {dtype}")
    return arr


def quantize_fp16(x: Array) -> Array:
    """float32 -> float16, rounded to nearest even (overflow to inf, NaN stays NaN)."""
    if _on_device(x):
        return _cuda().quantize_fp16(x)
    src = _host_f32(x, "x")
    out = np.empty(src.shape, np.float16)
    _C.quantize_fp16(src, out, src.size)
    return _like(out, x)


def dequantize_fp16(h: Array) -> Array:
    """float16 -> float32 (exact)."""
    if _on_device(h):
        return _cuda().dequantize_fp16(h)
    src, dtype = _host(h, "h")
    if dtype != "float16":
        raise TypeError(f"h: expected float16, got {dtype}")
    out = np.empty(src.shape, np.float32)
    _C.dequantize_fp16(src, out, src.size)
    return _like(out, h)


def quantize_int8(x: Array) -> tuple[Array, Array]:
    """x (read flat) -> (q int8, scales float32), one scale per INT8_BLOCK_SIZE elements.

    scale = max|x in block| / 127 and q = clamp(rint(x / scale), -127, 127), so each element
    is off by at most max|x in block| / 254 (+ rounding). An all-zero block has scale 0; a
    block holding NaN or inf has scale NaN, so it decodes to NaN rather than hiding it."""
    if _on_device(x):
        return _cuda().quantize_int8(x)
    src = _host_f32(x, "x")
    q = np.empty(src.size, np.int8)
    scales = np.empty(nblocks(src.size, INT8_BLOCK_SIZE), np.float32)
    _C.quantize_int8(src, q, scales, src.size)
    return _like(q, x), _like(scales, x)


def quantize_int4(x: Array) -> tuple[Array, Array]:
    """x (read flat, float32, host) -> (q uint8 of (size + 1) // 2 bytes, scales float32),
    one scale per INT4_BLOCK_SIZE elements, two values a byte (element 2k in the low nibble
    of q[k]). scale = max|x in block| / 7 and each value clamp(rint(x / scale), -7, 7), so
    an element is off by at most max|x in block| / 14 (+ rounding); zero and non-finite
    blocks as quantize_int8's. Host memory only: device data is staged by its caller."""
    src = _host_f32(x, "x")
    q = np.empty((src.size + 1) // 2, np.uint8)
    scales = np.empty(nblocks(src.size, INT4_BLOCK_SIZE), np.float32)
    _C.quantize_int4(src, q, scales, src.size)
    return _like(q, x), _like(scales, x)


def dequantize_int4(q: Array, scales: Array, count: int, out: Array | None = None) -> Array:
    """float32 vector of count elements: value i of q times scales[i // INT4_BLOCK_SIZE],
    into out (a float32 host vector of count elements) if given."""
    count = check_count(count)
    qs, dtype = _host(q, "q")
    if dtype != "uint8":
        raise TypeError(f"q: expected uint8 (two int4 values a byte), got {dtype}")
    sc = _host_f32(scales, "scales")
    dst = np.empty(count, np.float32) if out is None else _host_f32(out, "out")
    _C.dequantize_int4(qs, sc, dst, count)
    return _like(dst, q) if out is None else out


def topk_feedback(x: Array, residual: Array, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-K with error feedback (host float32, read flat): residual += x, in place; then
    the k entries of largest |residual| (ties: the lower index; NaN above any number) are
    returned as (indices int32 ascending, values float32) and zeroed in residual. Exactly:
    residual after, plus the values at their indices, equals x + residual before."""
    src = _host_f32(x, "x")
    res = _host_f32(residual, "residual")
    if res.size != src.size:
        raise ValueError(f"residual: expected {src.size} elements (x's), got {res.size}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= src.size:
        raise ValueError(f"k: expected an int in [0, {src.size}] (x's elements), got {k!r}")
    indices = np.empty(int(k), np.int32)
    values = np.empty(indices.size, np.float32)
    _C.topk_feedback(src, res, indices, values, src.size, k)
    return indices, values


def scatter_add(indices: np.ndarray, values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[indices[j]] += values[j] for each j in order (host: int32 indices, each within
    out, distinct; float32 values and out); returns out."""
    idx, dtype = _host(indices, "indices")
    if dtype != "int32":
        raise TypeError(f"indices: expected int32, got {dtype}")
    val, dst = _host_f32(values, "values"), _host_f32(out, "out")
    if val.size != idx.size:
        raise ValueError(f"values: expected {idx.size} elements (indices'), got {val.size}")
    _C.scatter_add(idx, val, dst, idx.size, dst.size)
    return out


def dequantize_int8(q: Array, scales: Array, count: int) -> Array:
    """float32 vector of count elements: q[i] * scales[i // INT8_BLOCK_SIZE]."""
    if _on_device(q):
        return _cuda().dequantize_int8(q, scales, count)
    count = check_count(count)
    qs, sc = _host(q, "q")[0], _host_f32(scales, "scales")
    out = np.empty(count, np.float32)
    _C.dequantize_int8(qs, sc, out, count)
    return _like(out, q)


def onebit_compress(
    x: Array, error: Array, block_size: int | None = None
) -> tuple[Array, Array]:
    """1-bit compression with error feedback (DeepSpeed's 1-bit Adam compressor).

    c = x + error; bits = packbits(c >= 0) ((count + 7) // 8 uint8, MSB first); the scale of
    each block (block_size elements; None = the whole vector) is ||c_block||_2 /
    sqrt(len(block)). error is updated IN PLACE to c - onebit_decompress(bits, scale), so
    what this step lost is sent next step. Returns (bits, scale): scale is a float32 scalar
    when block_size is None (0 for an empty x), else a float32 array of ceil(count / B).

    All-zero c gives scale 0 and error 0. A NaN in c makes its block's scale NaN, so that
    block decompresses to NaN and its error becomes NaN: the NaN is reported, not hidden
    (check gradients are finite first, as loss scalers do)."""
    if _on_device(x):
        return _cuda().onebit_compress(x, error, block_size)
    xs, es = _host_f32(x, "x"), _host_f32(error, "error")
    if es.size != xs.size:
        raise ValueError(f"error: has {es.size} elements, x has {xs.size}")
    count = xs.size
    block = block_length(block_size, count)
    bits = np.empty((count + 7) // 8, np.uint8)
    scales = np.zeros(max(nblocks(count, block), 1 if block_size is None else 0), np.float32)
    _C.onebit_compress(xs, es, bits, scales, count, block)
    scale = _like(scales, x)
    return _like(bits, x), scale[0] if block_size is None else scale


def onebit_decompress(
    bits: Array, scales: Array | float, count: int, block_size: int | None = None,
    out: np.ndarray | None = None,
) -> Array:
    """float32 vector of count elements: +scale where the bit is 1, -scale where it is 0.
    out: a host float32 array of count elements to write into (returned), or None."""
    if _on_device(bits):
        return _cuda().onebit_decompress(bits, scales, count, block_size)
    count = check_count(count)
    block = block_length(block_size, count)
    if out is None:
        out = np.empty(count, np.float32)
    elif out.dtype != np.float32 or out.size != count:
        raise ValueError(f"out: expected a float32 array of {count} elements, got "
                         f"{out.dtype} of {out.size}")
    _C.onebit_decompress(_host(bits, "bits")[0], _host_scales(scales, "scales"), out, count,
                         block)
    return _like(out, bits)


def onebit_accumulate(
    acc: Array,
    bits: Sequence[Array],
    scales: Sequence[Array | float],
    count: int,
    block_size: int | None = None,
) -> None:
    """acc += onebit_decompress(bits[k], scales[k], count, block_size) for each k in order,
    in place and without materializing any decompressed chunk (compressed allreduce's
    server side). acc is float32 with at least count elements."""
    if _on_device(acc):
        return _cuda().onebit_accumulate(acc, bits, scales, count, block_size)
    count = check_count(count)
    block = block_length(block_size, count)
    if len(bits) != len(scales):
        raise ValueError(f"scales: got {len(scales)} for {len(bits)} bits arrays")
    _C.onebit_accumulate(
        _host_f32(acc, "acc"),
        [_host(b, f"bits[{k}]")[0] for k, b in enumerate(bits)],
        [_host_scales(s, f"scales[{k}]") for k, s in enumerate(scales)],
        count,
        block,
    )


def onebit_serve(bits: Sequence[np.ndarray], scales: Sequence[np.ndarray | float],
                 error: np.ndarray, block_size: int | None = None) -> tuple[np.ndarray, Any]:
    """onebit_compress(acc, error, block_size) where acc = zeros accumulated with
    onebit_accumulate(acc, bits, scales, error.size, block_size): the same bits, scales and
    error, in one pass without materializing acc (compressed allreduce's server step; host
    arrays only: that step always runs on the host)."""
    es = _host_f32(error, "error")
    count = es.size
    block = block_length(block_size, count)
    out_bits = np.empty((count + 7) // 8, np.uint8)
    out_scales = np.zeros(max(nblocks(count, block), 1 if block_size is None else 0),
                          np.float32)
    _C.onebit_serve([_host(b, "bits")[0] for b in bits],
                    [_host_scales(s, "scales") for s in scales], es, out_bits, out_scales,
                    count, block)
    return out_bits, out_scales[0] if block_size is None else out_scales


def adam_update(p: Array, m: Array, v: Array, *, lr: float, c1: float = 1.0,
                sqrt_c2: float = 1.0, eps: float, decay: float = 1.0,
                bound: float = float("inf")) -> None:
    """Adam's parameter update from its moments, in place, in one pass over float32 host
    arrays p, m and v of one size:
      p = p * decay - lr * clamp((m / c1) / (sqrt(v) / sqrt_c2 + eps), -bound, bound)
    each operation rounded to float32 (csrc/kernels/adam.h). c1 and sqrt_c2: the bias
    corrections (1 - beta1^t, and the square root of 1 - beta2^t); decay: 1 - lr *
    weight_decay (decoupled); bound: each coordinate's largest step / lr. Host memory only:
    device tensors take torch's operations (optim/onebit_adam.py)."""
    ps, ms, vs = _host_f32(p, "p"), _host_f32(m, "m"), _host_f32(v, "v")
    for name, arr in (("m", ms), ("v", vs)):
        if arr.size != ps.size:
            raise ValueError(f"{name}: has {arr.size} elements, p has {ps.size}")
    _C.adam_update(ps, ms, vs, ps.size, lr, c1, sqrt_c2, eps, decay, bound)


def _host_scales(scales: Array | float, name: str) -> np.ndarray:
    """A scale given as a Python/NumPy float, 0-d or 1-d array or tensor, as float32 1-d."""
    if isinstance(scales, (float, int, np.floating)) and not isinstance(scales, bool):
        return np.full(1, scales, np.float32)
    if isinstance(scales, np.ndarray) or _is_torch(scales):
        return _host_f32(scales, name).reshape(-1)
    raise TypeError(f"{name}: expected a float or a float32 array, got {type(scales).__name__}")
