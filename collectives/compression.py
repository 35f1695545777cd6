"""Gradient compression for allreduce (Horovod's Compressor interface):
compress(x) -> (x', ctx) before the collective, decompress(x', ctx) after it."""

from __future__ import annotations

from typing import Any

import numpy as np

from .dtypes import FLOATING, numpy_dtype_name, torch_dtype, torch_dtype_name

try:
    import torch
except ImportError:
    torch = None


def _float_dtype(x: Any) -> str | None:
    """x's dtype name if x is a NumPy array or torch tensor of a floating dtype, else None:
    only those are compressed."""
    if isinstance(x, np.ndarray):
        name = numpy_dtype_name(x.dtype)
    elif torch is not None and isinstance(x, torch.Tensor):
        name = torch_dtype_name(x.dtype)
    else:
        return None
    return name if name in FLOATING else None


def _cast(x: Any, dtype_name: str) -> Any:
    if isinstance(x, np.ndarray):
        return x.astype(dtype_name)
    return x.to(torch_dtype(dtype_name))


class Compressor:
    """Identity: the tensor travels as it is."""

    name = "none"

    @staticmethod
    def compress(x: Any) -> tuple[Any, Any]:
        return x, None

    @staticmethod
    def decompress(x: Any, ctx: Any) -> Any:
        return x

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 (half the bytes); others are untouched."""

    name = "fp16"

    @staticmethod
    def compress(x: Any) -> tuple[Any, Any]:
        dtype = _float_dtype(x)
        if dtype is None:
            return x, None
        return _cast(x, "float16"), dtype

    @staticmethod
    def decompress(x: Any, ctx: Any) -> Any:
        return x if ctx is None else _cast(x, ctx)


def check_compression(compression: object) -> Compressor:
    if compression is None:
        return Compression.none
    if isinstance(compression, Compressor):
        return compression
    raise ValueError(f"compression: expected Compression.none, fp16 or int8, got {compression!r}")


class Int8Compressor(Compressor):
    """Floating tensors travel as int8 with one float32 scale per block of
    kernels.INT8_BLOCK_SIZE elements (about a quarter of float32's bytes). Quantized values
    cannot be summed as they travel, so allreduce gathers every rank's (q, scales) and each
    rank dequantizes and sums them in rank order (see quantized.py)."""

    name = "int8"

    @staticmethod
    def compress(x: Any) -> tuple[Any, Any]:
        from . import kernels

        if _float_dtype(x) is None:
            return x, None
        flat = np.asarray(x, dtype=np.float32).reshape(-1) if isinstance(x, np.ndarray) \
            else x.detach().float().reshape(-1)
        q, scales = kernels.quantize_int8(flat)
        return q, (scales, tuple(x.shape), x.dtype)

    @staticmethod
    def decompress(x: Any, ctx: Any) -> Any:
        from . import kernels

        if ctx is None:
            return x
        scales, shape, dtype = ctx
        out = kernels.dequantize_int8(x, scales, int(np.prod(shape, dtype=np.int64)))
        return out.reshape(shape).astype(dtype) if isinstance(out, np.ndarray) \
            else out.reshape(shape).to(dtype)



class Compression:
    """The available compressors (Horovod's names)."""

    none = Compressor()
    fp16 = FP16Compressor()
    int8 = Int8Compressor()
