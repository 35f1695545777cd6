"""reducescatter under compression: int8 gives bitwise each rank's rows of the sum, in rank
order, of every rank's rows compressed block by block (the reference computed here from
every rank's data, with the quantization kernels alone); fp16 is within float16's rounding
of the exact average; any row count (0, 1, n-1, odd), float dtypes, Sum and Average, in a
sync and an async call, as NumPy arrays and torch tensors; x is not modified."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_equal, rounding_bound

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
    # fp16 roundings: each rank's rows, n - 1 sums, the division, the result's dtype
    magnitude = sum(np.abs(_data(q, rows, "float64")) for q in range(n))[lo:lo + split[r]] / n
    assert np.all(np.abs(got - exact) <= rounding_bound("float16", n + 2, magnitude))


def test_compression_is_agreed_and_checked(comm):
    with pytest.raises(ValueError, match="compression: expected"):
        C.reducescatter(np.ones((4, 2), np.float32), compression="int4")
    with pytest.raises(ValueError, match="op: Compression.int8 supports"):
        C.reducescatter(np.ones((4, 2), np.float32), op=C.Max, compression=C.Compression.int8)
    ints = np.arange(4 * comm.Get_size(), dtype=np.int32).reshape(-1, 1)  # never compressed
    got = C.reducescatter(ints, op=C.Sum, compression=C.Compression.int8)
    assert_equal(got, C.reducescatter(ints, op=C.Sum), "int32")


def _onebit_reference(n: int, r: int, xs: list[np.ndarray], errors: list[np.ndarray],
                      block) -> np.ndarray:
    """Rank r's rows of one compressed_reducescatter, every rank's worker step simulated
    here with the kernels (errors updated in place)."""
    rows = even_split(xs[0].shape[0], n)
    elems = int(np.prod(xs[0].shape[1:]))
    counts = [k * elems for k in rows]
    padded = [-(-c // 8) * 8 for c in counts]
    total = np.zeros(counts[r], np.float32)
    for q in range(n):
        flat = xs[q].reshape(-1).astype(np.float32)
        at, err_at, mine = 0, 0, None
        for j in range(n):
            c = np.zeros(padded[j], np.float32)
            c[:counts[j]] = flat[at:at + counts[j]]
            bits, scales = kernels.onebit_compress(c, errors[q][err_at:err_at + padded[j]],
                                                   block) if padded[j] else (None, None)
            if j == r and padded[j]:
                mine = kernels.onebit_decompress(bits, scales, padded[j], block)[:counts[j]]
            at, err_at = at + counts[j], err_at + padded[j]
        if mine is not None:
            total += mine
    return (total / np.float32(n)).reshape((rows[r],) + xs[0].shape[1:])


@pytest.mark.parametrize("rows", [0, 1, 2, 7, 300])
@pytest.mark.parametrize("block", [None, 16])
def test_onebit_with_error_feedback(comm, rows, block):
    """Two calls on the same error buffer: bitwise the simulated worker steps; the error
    buffer holds what the first call lost."""
    from collectives.algorithms.onebit import scatter_error_size

    n, r = comm.Get_size(), comm.Get_rank()
    rows = rows if rows != 2 else n - 1
    counts = [k * 3 for k in even_split(rows, n)]
    size = scatter_error_size(counts)
    error = np.zeros(size, np.float32)
    simulated = [np.zeros(size, np.float32) for _ in range(n)]
    for call in range(2):
        xs = [_data(q + 10 * call, rows, "float32") for q in range(n)]
        got = C.compressed_reducescatter(xs[r], error, block_size=block)
        assert_equal(got, _onebit_reference(n, r, xs, simulated, block), f"call {call}")
        assert_equal(error, simulated[r], f"error after call {call}")
    assert rows == 0 or n * rows * 3 < 8 or np.abs(error).max() > 0
    with pytest.raises(ValueError, match="worker_error: expected a 1-D array of"):
        C.compressed_reducescatter(np.ones((n, 3), np.float32), np.zeros(1, np.float32))
