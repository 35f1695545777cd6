"""The dtype registry: every dtype the collectives move, and the facts the rest of the
package needs about it, in one table.

Per dtype name: its code (the DType enum of csrc/kernels/dtypes.h, which the C++ and agreement
calls take), the NumPy dtype of its storage (bfloat16, which NumPy lacks, as uint16 bits;
the CUDA kernels see the same storage), and whether it is floating (what compression,
scaling and NaN-aware Min/Max apply to). Lookups go from a NumPy or torch dtype to the name.
torch is optional, and never imported to look at an argument: an object can only be a torch
tensor once torch is imported (loaded_torch), so a NumPy-only job never pays torch's import
(about 1.6 s of CPU in every rank)."""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import numpy as np


class DType(NamedTuple):
    name: str
    code: int  # enum class DType in csrc/kernels/dtypes.h
    storage: np.dtype  # what a host or CuPy buffer of this dtype holds
    floating: bool


_TABLE = (
    DType("float16", 0, np.dtype(np.float16), True),
    DType("bfloat16", 1, np.dtype(np.uint16), True),
    DType("float32", 2, np.dtype(np.float32), True),
    DType("float64", 3, np.dtype(np.float64), True),
    DType("int8", 4, np.dtype(np.int8), False),
    DType("uint8", 5, np.dtype(np.uint8), False),
    DType("int32", 6, np.dtype(np.int32), False),
    DType("int64", 7, np.dtype(np.int64), False),
    DType("int16", 8, np.dtype(np.int16), False),
)

#: every supported dtype name, in code order
NAMES = tuple(d.name for d in _TABLE)
#: dtype name -> code in csrc/kernels/dtypes.h
CODES = {d.name: d.code for d in _TABLE}
#: dtype name -> NumPy dtype of its storage
STORAGE = {d.name: d.storage for d in _TABLE}
#: the floating dtype names, in code order
FLOATING = tuple(d.name for d in _TABLE if d.floating)

#: NumPy dtype -> name (bfloat16 has no NumPy dtype: its uint16 storage is not a bfloat16)
NUMPY_NAMES = {np.dtype(d.name): d.name for d in _TABLE if d.name != "bfloat16"}
#: torch dtype -> name, filled on the first lookup after torch is imported
_TORCH_NAMES: dict[Any, str] = {}


def loaded_torch() -> Any:
    """torch if this process has imported it, else None (then nothing it holds is a torch
    tensor or dtype): what the checks of an argument's kind look at, instead of importing it."""
    return sys.modules.get("torch")


def torch_dtype_name(dtype: Any) -> str | None:
    """Our name for a torch dtype, None if unsupported (or if torch was never imported, in
    which case dtype cannot be a torch dtype)."""
    if not _TORCH_NAMES:
        torch = loaded_torch()
        if torch is None:
            return None
        _TORCH_NAMES.update({getattr(torch, name): name for name in NAMES})
    return _TORCH_NAMES.get(dtype)


def torch_dtype(name: str) -> Any:
    """The torch dtype of a supported dtype name (imports torch)."""
    import torch

    if name not in STORAGE:
        raise ValueError(f"dtype: expected one of {list(NAMES)}, got {name!r}")
    return getattr(torch, name)
