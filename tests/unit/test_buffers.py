"""collectives/runtime/buffers.py on the host: wrap() views contiguous NumPy arrays and torch
CPU tensors (bfloat16 as its uint16 bits) and copies the rest; results come back in the
caller's type, dtype and shape; nothing passed in changes until an in-place write_back();
unsupported inputs raise a TypeError naming the argument; large results come from the pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from collectives.runtime import buffers
from collectives.runtime.buffers import POOL_MIN_BYTES, host_empty, wrap

NUMPY_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64"]
TORCH_DTYPES = NUMPY_DTYPES + ["bfloat16"]
SHAPES = [(), (0,), (0, 3), (1,), (7,), (3, 5), (2, 3, 4)]


def sample(shape: tuple, seed: int = 0) -> np.ndarray:
    """Small integers as float64: exact in every dtype, bfloat16 included."""
    return np.random.default_rng(seed).integers(-100, 100, size=shape).astype(np.float64)


def torch_of(a: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(a.copy()).to(getattr(torch, dtype))


def bits(t: torch.Tensor) -> np.ndarray:
    """t's values as the storage wrap() gives (bfloat16 as uint16), flattened in C order."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
    return t.contiguous().numpy().reshape(-1)


# --------------------------------------------------------------------------------- NumPy

@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_contiguous_array_is_viewed(dtype, shape):
    x = sample(shape).astype(dtype)
    buf = wrap(x)
    assert buf.dtype == dtype and buf.shape == shape and not buf.staged
    assert buf.flat.ndim == 1 and buf.flat.size == x.size and buf.flat.dtype == x.dtype
    assert buf.nbytes == x.nbytes
    if x.size:
        assert np.shares_memory(buf.flat, x), "contiguous input must be viewed, not copied"
        buf.flat[0] = 9
        assert x.reshape(-1)[0] == 9
    assert buf.result() is x


@pytest.mark.parametrize("make", [lambda a: a[:, ::2], lambda a: a.T, lambda a: a[::-1],
                                  lambda a: a[1:, 1:3]], ids=["strided", "T", "reversed", "slice"])
def test_a_non_contiguous_array_is_copied_and_written_back_only_in_place(make):
    base = sample((4, 6)).astype(np.float32)
    x = make(base)
    assert not x.flags.c_contiguous
    before = base.copy()
    buf = wrap(x)
    assert buf.staged and buf.shape == x.shape and buf.dtype == "float32"
    assert np.array_equal(buf.flat, x.reshape(-1)), "flat holds x's values in C order"
    assert not np.shares_memory(buf.flat, base)
    buf.flat[...] = np.arange(x.size)
    assert np.array_equal(base, before), "the caller's array changed before write_back()"
    out = buf.result()
    assert type(out) is np.ndarray and out.dtype == x.dtype and out.shape == x.shape
    assert np.array_equal(out, np.arange(x.size).reshape(x.shape))
    assert np.array_equal(base, before), "result() must not write into the caller's array"
    buf.write_back()
    assert np.array_equal(x, np.arange(x.size).reshape(x.shape))
    written = np.zeros(base.shape, bool)
    make(written)[...] = True
    assert np.array_equal(base[~written], before[~written]), "write_back reached outside x"


def test_a_zero_d_array_is_one_element_of_shape_empty_tuple():
    x = np.array(2.5, np.float64)
    buf = wrap(x)
    assert buf.shape == () and buf.flat.shape == (1,) and buf.flat[0] == 2.5
    empty = buf.empty(())
    empty.flat[0] = 4
    out = empty.result()
    assert type(out) is np.ndarray and out.shape == () and out.dtype == np.float64 and out == 4


# --------------------------------------------------------------------------------- torch

@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_contiguous_cpu_tensor_is_viewed(dtype, shape):
    t = torch_of(sample(shape), dtype)
    before = t.clone()
    buf = wrap(t)
    assert buf.dtype == dtype and buf.shape == shape and not buf.staged
    assert buf.flat.ndim == 1 and np.array_equal(buf.flat, bits(t))
    if dtype == "bfloat16":
        assert buf.flat.dtype == np.uint16, "bfloat16 is held as its uint16 bits"
    if t.numel():
        assert buf.flat.ctypes.data == t.data_ptr(), "contiguous input must be viewed"
    assert buf.result() is t and torch.equal(t, before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_a_non_contiguous_tensor_is_copied_and_written_back_only_in_place(dtype):
    base = torch_of(sample((5, 4)), dtype)
    x = base.t()[:, 1:]
    assert not x.is_contiguous()
    before = base.clone()
    buf = wrap(x)
    assert buf.staged and buf.shape == tuple(x.shape) and buf.dtype == dtype
    assert np.array_equal(buf.flat, bits(x))
    new = torch_of(np.arange(x.numel(), dtype=np.float64).reshape(x.shape), dtype)
    buf.flat[...] = bits(new)
    assert torch.equal(base, before), "the caller's tensor changed before write_back()"
    out = buf.result()
    assert type(out) is torch.Tensor and out.dtype == x.dtype and tuple(out.shape) == tuple(x.shape)
    assert torch.equal(out, new) and torch.equal(base, before)
    buf.write_back()
    assert torch.equal(x, new)
    assert torch.equal(base[0], before[0]), "write_back reached outside x"


def test_a_tensor_that_requires_grad_is_wrapped_without_its_graph():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_()
    buf = wrap(t)
    assert buf.dtype == "float32" and np.array_equal(buf.flat, np.arange(6))
    assert buf.result() is t


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_empty_makes_a_result_of_the_callers_kind_dtype_and_shape(dtype):
    for x in (torch_of(sample((3,)), dtype), sample((3,)).astype(np.float32)):
        if dtype == "bfloat16" and isinstance(x, np.ndarray):
            continue
        out = wrap(x).empty((2, 5))
        out.flat[...] = bits(torch_of(np.arange(10.0), dtype)) if isinstance(x, torch.Tensor) \
            else np.arange(10.0)
        got = out.result()
        assert type(got) is type(x) and got.dtype == x.dtype and tuple(got.shape) == (2, 5)
        as_float = got.float().numpy() if isinstance(got, torch.Tensor) else got
        assert np.array_equal(as_float, np.arange(10.0).reshape(2, 5))


# ------------------------------------------------------------------------- bad arguments

@pytest.mark.parametrize("bad,what", [
    (np.zeros(3, np.complex64), "complex64"),
    (np.zeros(3, bool), "bool"),
    (np.zeros(3, np.uint16), "uint16"),  # bfloat16's storage, not a dtype of ours
    (np.zeros(3, np.uint64), "uint64"),
    (torch.zeros(3, dtype=torch.complex64), "complex64"),
    (torch.zeros(3, dtype=torch.bool), "bool"),
    ([1.0, 2.0], "list"),
    (3.0, "float"),
    (None, "NoneType"),
])
def test_an_unsupported_input_is_a_type_error_naming_the_argument(bad, what):
    with pytest.raises(TypeError, match=rf"^tensor: .*{what}"):
        wrap(bad, "tensor")


# -------------------------------------------------------------------------- result pool

def test_results_from_pool_min_bytes_up_come_from_the_pool():
    small = host_empty((POOL_MIN_BYTES // 8 - 1,), np.float64)
    assert small.flags.owndata, "below POOL_MIN_BYTES: plain malloc'd memory"
    for shape, dtype in [((POOL_MIN_BYTES,), np.uint8), ((POOL_MIN_BYTES // 32, 4), np.float64)]:
        big = host_empty(shape, dtype)
        assert not big.flags.owndata and big.base is not None, "from the pool"
        assert big.shape == shape and big.dtype == dtype and big.flags.writeable
        assert big.flags.c_contiguous
        big[...] = 1
        assert big.sum() == big.size


# ------------------------------------------------------------------- floating storage

def test_bfloat16_storage_widens_exactly_and_stores_rounded_to_nearest_even():
    values = np.array([1.0, -2.5, 3.140625, 1e30, 0.0], np.float32)
    flat = np.empty(values.size, np.uint16)
    buffers.store_float(flat, "bfloat16", values)
    assert np.array_equal(buffers.host_float(flat, "bfloat16"),
                          torch.from_numpy(values).to(torch.bfloat16).float().numpy())
    halfway = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8], np.float32)  # ties: to even
    buffers.store_float(flat[:2], "bfloat16", halfway)
    assert buffers.host_float(flat[:2], "bfloat16").tolist() == [1.0, 1 + 4 * 2.0 ** -8]
    f32 = np.arange(4, dtype=np.float32)
    assert buffers.host_float(f32, "float32") is f32
