"""The dtype registry (collectives/dtypes.py) against the C++ enum it mirrors and the NumPy
and torch dtypes it names."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from collectives import _C, dtypes

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "kernels" / "dtypes.h"
#: enumerator of csrc/kernels/dtypes.h -> our name
CPP_NAMES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
             "i8": "int8", "u8": "uint8", "i32": "int32", "i64": "int64", "i16": "int16"}


def test_codes_are_the_cpp_enum():
    body = re.search(r"enum class DType : int \{([^}]*)\}", HEADER.read_text()).group(1)
    enum = {CPP_NAMES[k]: int(v) for k, v in re.findall(r"(\w+)\s*=\s*(\d+)", body)}
    assert enum == dtypes.CODES
    assert list(dtypes.NAMES) == sorted(dtypes.CODES, key=dtypes.CODES.get)


def test_storage_is_what_the_kernels_read():
    for name in dtypes.NAMES:
        storage = dtypes.STORAGE[name]
        assert storage == (np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name))
        # the C++ element is exactly one storage element, and only storage passes
        _C.divide(np.zeros(1, storage), 1, dtypes.CODES[name], 1)
        with pytest.raises(ValueError, match="holds 0 elements, need 1"):
            _C.divide(np.zeros(0, storage), 1, dtypes.CODES[name], 1)
        other = np.int8 if storage.itemsize > 1 else np.uint16
        with pytest.raises(TypeError, match=f"expected {name} elements"):
            _C.divide(np.zeros(4, other), 1, dtypes.CODES[name], 1)


def test_floating_is_what_numpy_and_torch_call_floating():
    """FLOATING (what compression, scaling and NaN-aware Min/Max apply to) is exactly the
    names torch calls floating point, in code order; NumPy agrees on every name it has
    (all but bfloat16, whose storage is uint16 bits)."""
    assert dtypes.FLOATING == tuple(n for n in dtypes.NAMES if getattr(torch, n).is_floating_point)
    for name in dtypes.NAMES:
        if name != "bfloat16":
            assert (np.dtype(name).kind == "f") == (name in dtypes.FLOATING), name


def test_numpy_names():
    for name in dtypes.NAMES:
        expected = None if name == "bfloat16" else name
        assert dtypes.NUMPY_NAMES.get(np.dtype(name) if expected else np.dtype(np.uint16)) \
            == expected
    for other in (np.bool_, np.complex64, np.dtype(">f4"), np.uint16, np.uint32):
        assert dtypes.NUMPY_NAMES.get(np.dtype(other)) is None


def test_torch_names():
    for name in dtypes.NAMES:
        assert dtypes.torch_dtype_name(getattr(torch, name)) == name
        assert dtypes.torch_dtype(name) is getattr(torch, name)
    for other in (torch.bool, torch.uint32, torch.complex64, np.dtype(np.float32), "float32"):
        assert dtypes.torch_dtype_name(other) is None
    with pytest.raises(ValueError, match="dtype"):
        dtypes.torch_dtype("bool")
