"""Argument checks, sizes and the CUDA sources' folder that the host face of the kernels
(kernels/__init__.py) and the device face (kernels/cuda.py) share, kept apart from both so
that neither imports the other's module: the host face imports cuda.py (and with it CuPy)
only when device memory is used, and cuda.py needs nothing else from the host face."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

#: The .cu files CuPy compiles at first use (csrc/cuda in the repository).
CUDA_SOURCES = Path(__file__).resolve().parents[2] / "csrc" / "cuda"

#: Elements sharing one float32 scale in quantize_int8 (kInt8Block in csrc/kernels/quantize.h,
#: INT8_BLOCK in csrc/cuda/quantize.cu).
INT8_BLOCK_SIZE = 256
#: Elements sharing one float32 scale in quantize_int4 (kInt4Block in csrc/kernels/quantize.h).
INT4_BLOCK_SIZE = 128


def _is_int(x: object) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_count(count: int) -> int:
    """count as an int, or ValueError if it is not an int >= 0."""
    if not _is_int(count) or count < 0:
        raise ValueError(f"count: expected an int >= 0, got {count!r}")
    return int(count)


def block_length(block_size: int | None, count: int) -> int:
    """The kernels' block length: None means one block for the whole vector."""
    if block_size is None:
        return max(count, 1)
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size: expected None or an int >= 1, got {block_size!r}")
    return int(block_size)


def nblocks(count: int, block: int) -> int:
    """How many blocks of `block` elements cover `count` (the last may be short)."""
    return -(-count // block)


def like(arr: Any, ref: Any, dtype: str | None, convert: str) -> Any:
    """arr as the kind of ref: if ref is a torch tensor, a tensor sharing arr's memory made
    by torch.<convert> (from_numpy for host arrays, from_dlpack for CuPy), bfloat16 through
    its int16 bits; else arr itself."""
    if not type(ref).__module__.startswith("torch"):
        return arr
    torch = sys.modules["torch"]
    make = getattr(torch, convert)
    if dtype == "bfloat16":
        return make(arr.view(np.int16)).view(torch.bfloat16)
    return make(arr)
