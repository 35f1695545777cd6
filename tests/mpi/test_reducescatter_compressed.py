"""reducescatter under compression: int8 gives bitwise each rank's rows of the sum, in rank
order, of every rank's rows compressed block by block (the reference computed here from
every rank's data, with the quantization kernels alone); fp16 is within float16's rounding
of the exact average; any row count (0, 1, n-1, odd), float dtypes, Sum and Average, in a
sync and an async call, as NumPy arrays and torch tensors; x is not modified."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_equal

import collectives as C
from collectives import kernels
from collectives.runtime.p2p import even_split


def _data(rank: int, rows: int, dtype: str) -> np.ndarray:
    g = np.random.default_rng(100 + rank)
    return g.standard_normal((rows, 3)).astype(dtype)


def _int8_reference(n: int, r: int, rows: int, dtype: str, op) -> np.ndarray:
    split = even_split(rows, n)
    lo, hi = sum(split[:r]) * 3, sum(split[:r + 1]) * 3
    total = None
    for q in range(n):
        part = _data(q, rows, dtype).reshape(-1)[lo:hi].astype(np.float32)
        values, scales = kernels.quantize_int8(part)
        back = kernels.dequantize_int8(values, scales, part.size)
        total = back if total is None else (total + back).astype(np.float32)
    if total is None:
        total = np.zeros(0, np.float32)
    if op is C.Average:
        total = total / np.float32(n)
    return total.astype(dtype).reshape(split[r], 3)


@pytest.mark.parametrize("rows", [0, 1, 2, 7, 300])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", [C.Sum, C.Average])
def test_int8_is_the_blockwise_compressed_sum(comm, rows, dtype, op):
    n, r = comm.Get_size(), comm.Get_rank()
    rows = max(rows, 0) if rows != 2 else n - 1
    x = _data(r, rows, dtype)
    before = x.copy()
    got = C.reducescatter(x, op=op, compression=C.Compression.int8)
    assert_equal(got, _int8_reference(n, r, rows, dtype, op), f"int8 {rows} rows")
    assert_equal(x, before, "x")
    handle = C.reducescatter_async(torch.from_numpy(x), op=op, compression=C.Compression.int8)
    assert_equal(C.synchronize(handle).numpy(), got, "async torch")


@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_fp16_is_within_float16_rounding(comm, rows, dtype):
    n, r = comm.Get_size(), comm.Get_rank()
    got = C.reducescatter(_data(r, rows, dtype), compression=C.Compression.fp16)
    split = even_split(rows, n)
    lo = sum(split[:r])
    exact = sum(_data(q, rows, "float64") for q in range(n))[lo:lo + split[r]] / n
    assert got.dtype == np.dtype(dtype) and got.shape == exact.shape
    assert np.abs(got - exact).max(initial=0) <= 2e-3 * n


def test_compression_is_agreed_and_checked(comm):
    with pytest.raises(ValueError, match="compression: expected"):
        C.reducescatter(np.ones((4, 2), np.float32), compression="int4")
    with pytest.raises(ValueError, match="op: Compression.int8 supports"):
        C.reducescatter(np.ones((4, 2), np.float32), op=C.Max, compression=C.Compression.int8)
    ints = np.arange(4 * comm.Get_size(), dtype=np.int32).reshape(-1, 1)  # never compressed
    got = C.reducescatter(ints, op=C.Sum, compression=C.Compression.int8)
    assert_equal(got, C.reducescatter(ints, op=C.Sum), "int32")
