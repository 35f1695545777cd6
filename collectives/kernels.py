"""Python face of the C++ kernels (collectives._C) on host buffers.

Buffers are 1-D C-contiguous NumPy arrays; half types travel as 2-byte storage (NumPy
float16, or uint16 holding bfloat16 bits) and the dtype name says how to read them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .ops import ReduceOp

try:
    from . import _C
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "collectives._C (the C++ kernels) is not built. Install the package with "
        "`pip install -e .` (or `make install`) from the repository root."
    ) from exc

#: dtype name -> code in csrc/cpu/dtypes.h
DTYPE_CODES = {
    "float16": 0, "bfloat16": 1, "float32": 2, "float64": 3,
    "int8": 4, "uint8": 5, "int32": 6, "int64": 7,
}
#: dtype name -> NumPy dtype of its storage
STORAGE = {
    "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8),
    "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
}


def reduce(dst: np.ndarray, srcs: Sequence[np.ndarray], dtype: str, op: ReduceOp) -> None:
    """dst = srcs[0] op srcs[1] op ... elementwise (dst may be srcs[0]); op is not Average."""
    _C.reduce(dst, list(srcs), dst.size, DTYPE_CODES[dtype], int(op))


def divide(buf: np.ndarray, dtype: str, divisor: int) -> None:
    """buf /= divisor in place; floor division for integer dtypes."""
    _C.divide(buf, buf.size, DTYPE_CODES[dtype], divisor)
