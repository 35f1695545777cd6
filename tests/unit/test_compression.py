"""collectives/compression/__init__.py on one process: the fp16, int8 and int4
compress/decompress pairs against NumPy references (fp16 exact where float16 can hold the
value and rounded as NumPy rounds elsewhere; int8 and int4 within half of their block's
scale, max|x|/127 and max|x|/7), Compression.none passing arrays through,
check_compression's errors, int8's combine() summing every rank's pair in rank order (bit
for bit, against a float32 NumPy sum in that order), and twophase.py's chunks and `auto`'s
choice of form by cost on made-up layouts."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from fake_topology import FakeTopology

from collectives.compression import (
    Compression,
    Int4Compressor,
    Int8Compressor,
    check_compression,
    twophase,
)
from collectives.kernels import INT4_BLOCK_SIZE, INT8_BLOCK_SIZE
from collectives.ops import ReduceOp

SHAPES = [(0,), (1,), (7,), (3, 5), (2, INT8_BLOCK_SIZE + 3), (4 * INT8_BLOCK_SIZE,)]


def values(shape: tuple, seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def block_scales(x: np.ndarray) -> np.ndarray:
    """max|x| / 127 per INT8_BLOCK_SIZE block of x (read flat): the reference scales."""
    flat = np.abs(x.reshape(-1).astype(np.float64))
    return np.array([flat[lo:lo + INT8_BLOCK_SIZE].max() / 127
                     for lo in range(0, flat.size, INT8_BLOCK_SIZE)])


def per_element(scales: np.ndarray, count: int) -> np.ndarray:
    return np.repeat(scales, INT8_BLOCK_SIZE)[:count]


# ---------------------------------------------------------------------------------- none

@pytest.mark.parametrize("x", [np.arange(5.0), torch.arange(4), np.zeros((2, 0), np.int8)])
def test_none_passes_arrays_through(x):
    sent, ctx = Compression.none.compress(x)
    assert sent is x
    assert Compression.none.decompress(sent, ctx) is x


# ---------------------------------------------------------------------------------- fp16

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp16_is_exact_for_values_float16_holds(dtype, shape):
    x = values(shape, 1, 100).astype(np.float16).astype(dtype)  # representable in float16
    x.reshape(-1)[:3] = [65504.0, -(2.0 ** -24), 0.0][: x.size]  # largest, least subnormal, 0
    before = x.copy()
    sent, ctx = Compression.fp16.compress(x)
    assert isinstance(sent, np.ndarray) and sent.dtype == np.float16 and sent.shape == shape
    back = Compression.fp16.decompress(sent, ctx)
    assert back.dtype == x.dtype and back.shape == shape
    assert np.array_equal(back, x) and np.array_equal(x, before)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fp16_rounds_as_numpy_does(dtype):
    x = np.concatenate([values((1000,), 2, 1e3), [1e6, -1e6, 1 + 2.0 ** -11, np.nan, np.inf]])
    x = x.astype(dtype)
    sent, _ = Compression.fp16.compress(x)
    expected = x.astype(np.float16)  # to nearest even; overflow to inf
    assert np.array_equal(sent.view(np.uint16)[~np.isnan(x)],
                          expected.view(np.uint16)[~np.isnan(x)])
    assert np.isnan(sent[np.isnan(x)]).all()


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_fp16_keeps_torch_tensors_and_their_dtype(dtype):
    x = torch.tensor([[1.5, -2.25], [1024.0, 0.125]], dtype=getattr(torch, dtype))
    sent, ctx = Compression.fp16.compress(x)
    assert isinstance(sent, torch.Tensor) and sent.dtype == torch.float16
    back = Compression.fp16.decompress(sent, ctx)
    assert isinstance(back, torch.Tensor) and back.dtype == x.dtype and torch.equal(back, x)


@pytest.mark.parametrize("compression", [Compression.fp16, Compression.int8])
@pytest.mark.parametrize("x", [np.arange(6, dtype=np.int32), torch.arange(5, dtype=torch.int64),
                               np.ones(3, np.uint8)], ids=["np-int32", "torch-int64", "np-uint8"])
def test_non_floating_arrays_are_never_compressed(compression, x):
    sent, ctx = compression.compress(x)
    assert sent is x and ctx is None
    assert compression.decompress(sent, ctx) is x


# ---------------------------------------------------------------------------------- int8

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_round_trip_is_within_half_a_block_scale(dtype, shape):
    x = values(shape, 3, 10).astype(dtype)
    if x.size > INT8_BLOCK_SIZE:
        x.reshape(-1)[:INT8_BLOCK_SIZE] *= 1000   # blocks of very different ranges
        x.reshape(-1)[-1] = 0.0
    before = x.copy()
    q, ctx = Compression.int8.compress(x)
    assert q.dtype == np.int8 and q.size == x.size
    scales = ctx[0]
    want = block_scales(x)
    assert scales.dtype == np.float32 and scales.size == want.size
    np.testing.assert_allclose(scales, want, rtol=1e-6)
    assert np.abs(q.astype(int)).max(initial=0) <= 127
    back = Compression.int8.decompress(q, ctx)
    assert type(back) is np.ndarray and back.dtype == x.dtype and back.shape == shape
    bound = per_element(want, x.size).reshape(shape) * (0.5 + 1e-5)
    assert np.all(np.abs(back.astype(np.float64) - x) <= bound)
    assert np.array_equal(x, before), "compress modified its input"


def test_int8_all_zero_blocks_and_torch_tensors():
    x = torch.zeros(2 * INT8_BLOCK_SIZE + 1, dtype=torch.bfloat16)
    x[INT8_BLOCK_SIZE:] = torch.linspace(-3, 3, INT8_BLOCK_SIZE + 1)
    q, ctx = Compression.int8.compress(x)
    assert float(ctx[0][0]) == 0.0, "an all-zero block has scale 0"
    back = Compression.int8.decompress(q, ctx)
    assert isinstance(back, torch.Tensor) and back.dtype == torch.bfloat16 and back.shape == x.shape
    assert torch.all(back[:INT8_BLOCK_SIZE] == 0)
    err = (back.double() - x.double()).abs()[INT8_BLOCK_SIZE:]
    assert err.max() <= 3 / 127 / 2 + 3 * 2.0 ** -8, "half a scale, plus bfloat16's rounding"


def test_int8_refuses_ops_it_cannot_add():
    for op in (ReduceOp.Sum, ReduceOp.Average):
        Compression.int8.check_op(op)
    for op in (ReduceOp.Min, ReduceOp.Max, ReduceOp.Product):
        with pytest.raises(ValueError, match=rf"^op: Compression.int8 supports .*got {op.name}"):
            Compression.int8.check_op(op)
    Compression.fp16.check_op(ReduceOp.Max)


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("op", [ReduceOp.Sum, ReduceOp.Average])
def test_combine_sums_every_ranks_pair_in_rank_order(ranks, op):
    shape = (3, INT8_BLOCK_SIZE - 1)
    count = int(np.prod(shape))
    # rows of very different magnitudes, so float32 sums in another order differ
    rows = [values(shape, 10 + r, (1e-3, 1.0, 1e3)[r % 3]) for r in range(ranks)]  # literals: no pow
    pairs = [Compression.int8.compress(x) for x in rows]
    all_q = np.stack([q for q, _ in pairs])
    all_scales = np.stack([ctx[0] for _, ctx in pairs])
    got = Compression.int8.combine(all_q, all_scales, shape, op, ranks)

    decoded = [all_q[r].astype(np.float32) * per_element(all_scales[r], count).astype(np.float32)
               for r in range(ranks)]
    expected = decoded[0].copy()
    for part in decoded[1:]:
        expected = expected + part  # float32, rank 0 first
    if op is ReduceOp.Average:
        expected = expected / np.float32(ranks)
    assert got.dtype == np.float32 and got.shape == shape
    assert np.array_equal(got, expected.reshape(shape)), "not rank order's float32 sum"
    if ranks >= 3:
        reverse = decoded[-1].copy()
        for part in decoded[-2::-1]:
            reverse = reverse + part
        assert not np.array_equal(reverse, expected), "the data must tell the orders apart"


# ------------------------------------------------------------------- check_compression

def test_check_compression_accepts_none_and_the_compressors():
    assert check_compression(None) is Compression.none
    for c in (Compression.none, Compression.fp16, Compression.int8, Compression.int4,
              Int4Compressor("two-phase")):
        assert check_compression(c) is c


@pytest.mark.parametrize("bad", ["fp16", "none", 1, True, object, Compression, type(Compression.fp16)])
def test_check_compression_names_a_bad_value(bad):
    with pytest.raises(ValueError, match=r"^compression: expected Compression.none, fp16, int8, "
                                         r"int4 or Compression.topk\(ratio\), "
                                         rf"got {re.escape(repr(bad))}$"):
        check_compression(bad)


# ---------------------------------------------------------------------------------- int4

@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5), (2, INT4_BLOCK_SIZE + 3)])
def test_int4_round_trip_is_within_half_a_block_scale(shape):
    x = values(shape, 4, 10)
    before = x.copy()
    q, ctx = Compression.int4.compress(x)
    assert q.dtype == np.uint8 and q.size == (x.size + 1) // 2
    back = Compression.int4.decompress(q, ctx)
    assert back.dtype == x.dtype and back.shape == shape
    flat = np.abs(x.reshape(-1).astype(np.float64))
    scales = np.array([flat[lo:lo + INT4_BLOCK_SIZE].max() / 7
                       for lo in range(0, flat.size, INT4_BLOCK_SIZE)])
    bound = np.repeat(scales, INT4_BLOCK_SIZE)[:x.size].reshape(shape) * (0.5 + 1e-5)
    assert np.all(np.abs(back.astype(np.float64) - x) <= bound)
    assert np.array_equal(x, before)


def test_int4_refuses_ops_it_cannot_add_and_keeps_torch_dtypes():
    with pytest.raises(ValueError, match=r"^op: Compression.int4 supports .*got Max"):
        Compression.int4.check_op(ReduceOp.Max)
    x = torch.linspace(-3, 3, 300, dtype=torch.bfloat16)
    back = Compression.int4.decompress(*Compression.int4.compress(x))
    assert back.dtype == torch.bfloat16 and back.shape == x.shape
    assert (back.double() - x.double()).abs().max() <= 3 / 7 / 2 + 3 * 2.0 ** -8


# ------------------------------------------------------------------------------ forms

def test_a_fixed_form_is_in_the_name_and_a_bad_one_is_refused():
    assert repr(Compression.int8) == "Compression.int8"
    assert Int8Compressor("two-phase").name == "int8/two-phase"
    assert Int4Compressor("allgather").name == "int4/allgather"
    with pytest.raises(ValueError, match=r"^form: expected 'auto' or one of \['allgather', "
                                         r"'two-phase'\], got 'ring'$"):
        Int8Compressor("ring")


@pytest.mark.parametrize("codec", [Compression.int8, Compression.int4])
def test_auto_takes_two_phases_where_the_allgather_would_grow_with_the_ranks(codec):
    """Two ranks receive as many bytes either way, in one step fewer by allgather; from
    three, large vectors go in two phases, on one node and across nodes alike; small ones,
    paying each phase's steps, go by allgather; one rank needs no exchange."""
    big, small = 1 << 20, 16
    assert twophase.choose(FakeTopology(1), codec, big) == "allgather"
    assert twophase.choose(FakeTopology(2), codec, big) == "allgather"
    assert twophase.choose(FakeTopology(1, 1), codec, big) == "allgather"
    for layout in [(3,), (4,), (8,), (1, 1, 1, 1), (2, 2), (4, 4), (2, 1)]:
        topo = FakeTopology(*layout)
        assert twophase.choose(topo, codec, big) == "two-phase", layout
        assert twophase.choose(topo, codec, small) == "allgather", layout
        ratio = twophase.cost("allgather", topo, codec, big) / twophase.cost(
            "two-phase", topo, codec, big)
        assert ratio > 1, layout
    # the allgather form's bytes grow with the ranks, the two phases' do not
    grow = [twophase.cost("allgather", FakeTopology(*(1,) * n), codec, big) for n in (4, 16)]
    flat_ = [twophase.cost("two-phase", FakeTopology(*(1,) * n), codec, big) for n in (4, 16)]
    assert grow[1] / grow[0] > 4 and flat_[1] / flat_[0] < 1.5


@pytest.mark.parametrize("count,n,block", [(0, 3, 256), (1, 3, 256), (256, 3, 256),
                                           (257, 2, 256), (1000, 4, 128), (5 * 128 + 1, 3, 128)])
def test_chunks_are_whole_blocks(count, n, block):
    bounds = twophase.chunk_bounds(count, n, block)
    assert len(bounds) == n + 1 and bounds[0] == 0 and bounds[-1] == count
    assert all(b % block == 0 or b == count for b in bounds) and bounds == sorted(bounds)
    sizes = [-(-(b - a) // block) for a, b in zip(bounds, bounds[1:])]
    assert max(sizes) - min(sizes) <= 1
