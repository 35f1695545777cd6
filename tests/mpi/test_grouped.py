"""grouped_allreduce: every tensor of a list reduced in one call, against per-tensor
references; one agreement checks the whole group."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    DTYPES,
    OPS,
    assert_equal,
    assert_same_on_all_ranks,
    make_input,
    reference_reduce,
    skip_unrunnable,
    split_rows,
    to_framework,
    to_numpy,
)

import collectives as C

SHAPES = [(0,), (1,), (5,), (3, 4), (2, 0, 2), (1000,)]


@pytest.mark.parametrize("algo", list(C.ALGORITHMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_per_tensor_references(comm, algo, dtype):
    from collectives.runtime import topology

    if algo == "shm" and len(topology.get().nodes) > 1:
        pytest.skip("shm needs one node")
    if algo == "hierarchical" and len(topology.get().nodes) < 2:
        pytest.skip("hierarchical needs several nodes")
    r, n = comm.Get_rank(), comm.Get_size()
    for op in OPS:
        data = [make_input(dtype, s, seed=31 * r + k + 7 * int(op)) for k, s in enumerate(SHAPES)]
        refs = [reference_reduce(comm.allgather(d), op, dtype, n) for d in data]
        framework = "torch" if dtype == "bfloat16" else ("numpy" if op % 2 else "torch")
        xs = [to_framework(d, dtype, framework) for d in data]
        got = C.grouped_allreduce(xs, op=op, algorithm=algo)
        assert len(got) == len(xs)
        for k, (g, ref) in enumerate(zip(got, refs)):
            assert type(g) is type(xs[k]) and tuple(g.shape) == SHAPES[k]
            assert_equal(to_numpy(g), ref, f"{algo} {op.name} {dtype} tensor {k}")
            assert_same_on_all_ranks(comm, to_numpy(g), "grouped")
        C.grouped_allreduce_(xs, op=op, algorithm=algo)
        for k, ref in enumerate(refs):
            assert_equal(to_numpy(xs[k]), ref, f"in place {k}")


def test_async_small_and_compressed(comm):
    n = comm.Get_size()
    xs = [np.full(4, 1.5, np.float32), np.full((2, 3), 2.0, np.float32)]
    h = C.grouped_allreduce_async(xs, op=C.Sum)
    got = C.synchronize(h)
    assert_equal(got[1], np.full((2, 3), 2.0 * n, np.float32), "async")
    halves = C.grouped_allreduce(xs, op=C.Sum, compression=C.Compression.fp16)
    assert_equal(halves[0], np.full(4, 1.5 * n, np.float32), "fp16")
    ts = [torch.ones(3), torch.ones(2)]
    C.synchronize(C.grouped_allreduce_async_(ts, op=C.Sum))
    assert torch.equal(ts[1], torch.full((2,), float(n)))


@pytest.mark.mpi(min_size=2)
def test_a_group_that_differs_raises_everywhere(comm):
    r = comm.Get_rank()
    xs = [np.ones(3), np.ones(2 + (r == 0))]
    with pytest.raises(C.MismatchError, match="grouped_allreduce shapes mismatch"):
        C.grouped_allreduce(xs)
    assert C.grouped_allreduce([np.ones(2)], op=C.Sum)[0].tolist() == [comm.Get_size()] * 2


def test_bad_groups_name_the_argument():
    with pytest.raises(TypeError, match="tensors"):
        C.grouped_allreduce(np.ones(3))
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        C.grouped_allreduce([np.ones(2, np.float32), np.ones(2, np.float64)])
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        C.grouped_allreduce([np.ones(2), "x"])


def test_mixed_and_non_contiguous_groups(comm):
    """Not all contiguous host arrays of one kind: the staged path, same results."""
    n, r = comm.Get_size(), comm.Get_rank()
    base = np.arange(12, dtype=np.float64).reshape(3, 4) + r
    xs = [base[:, ::2], torch.full((2,), float(r), dtype=torch.float64), base.T]
    expected = [sum(np.arange(12.0).reshape(3, 4)[:, ::2] + q for q in range(n)),
                np.full(2, float(sum(range(n)))), sum(np.arange(12.0).reshape(3, 4).T + q
                                                      for q in range(n))]
    got = C.grouped_allreduce(xs, op=C.Sum)
    for g, e, x in zip(got, expected, xs):
        assert type(g) is type(x)
        assert_equal(to_numpy(g), e, "mixed")
    C.grouped_allreduce_(xs, op=C.Sum)
    assert_equal(xs[0], expected[0], "in place, non-contiguous")


@pytest.mark.parametrize("algo", list(C.ALGORITHMS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int64"])
def test_grouped_allgather_matches_per_tensor_allgathers(comm, algo, dtype):
    """Every tensor's dim 0 differs per rank (0 rows included); one call gathers all."""
    skip_unrunnable(algo)
    r, n = comm.Get_rank(), comm.Get_size()
    row_shapes = [(), (3,), (2, 2), (0,)]
    data = [make_input(dtype, ((r + k) % 3,) + s, seed=17 * r + k)
            for k, s in enumerate(row_shapes)]
    framework = "torch" if dtype == "bfloat16" else ("numpy" if r % 2 else "torch")
    got = C.grouped_allgather([to_framework(d, dtype, framework) for d in data], algorithm=algo)
    for k, (g, d) in enumerate(zip(got, data)):
        expected = np.concatenate(comm.allgather(d))
        assert_equal(to_numpy(g), expected, f"tensor {k}")
        assert type(g) is (np.ndarray if framework == "numpy" else torch.Tensor)
    h = C.grouped_allgather_async([np.full((r + 1, 2), r, np.int32)])
    assert_equal(C.synchronize(h)[0],
                 np.concatenate([np.full((q + 1, 2), q, np.int32) for q in range(n)]), "async")
    assert C.grouped_allgather([]) == []


@pytest.mark.parametrize("algo", list(C.ALGORITHMS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_grouped_reducescatter_matches_per_tensor_reducescatters(comm, algo, dtype):
    skip_unrunnable(algo)
    r, n = comm.Get_rank(), comm.Get_size()
    shapes = [(2 * n + 1, 3), (n,), (1,), (0, 4), (5 * n - 1,)]
    for op in (C.Sum, C.Average, C.Min):
        data = [make_input(dtype, s, seed=13 * r + k + int(op)) for k, s in enumerate(shapes)]
        framework = "torch" if dtype == "bfloat16" else ("numpy" if r % 2 else "torch")
        got = C.grouped_reducescatter([to_framework(d, dtype, framework) for d in data], op=op,
                                      algorithm=algo)
        for k, (g, d) in enumerate(zip(got, data)):
            full = reference_reduce(comm.allgather(d), op, dtype, n)
            cut = split_rows(d.shape[0], n)
            assert_equal(to_numpy(g), full[cut[r]:cut[r + 1]], f"{op} tensor {k}")
    h = C.grouped_reducescatter_async([np.ones((n, 2), np.float64)], op=C.Sum)
    assert_equal(C.synchronize(h)[0], np.full((1, 2), float(n)), "async")


def test_grouped_gather_and_scatter_errors_are_raised_everywhere(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    with pytest.raises(TypeError, match="tensors: one dtype per group"):
        C.grouped_allgather([np.ones(2, np.float32), np.ones(2, np.float64)])
    with pytest.raises(ValueError, match=r"tensors\[1\]: needs at least one dimension"):
        C.grouped_reducescatter([np.ones(2), np.array(1.0)])
    if n > 1:
        with pytest.raises(C.MismatchError, match="grouped_allgather row_shapes mismatch"):
            C.grouped_allgather([np.ones((1, r + 1))])
    assert_same_on_all_ranks(comm, C.grouped_allgather([np.arange(3.0)])[0], "usable after")


def test_counts_too_large_for_the_agreement_travel_by_allgather(comm, monkeypatch):
    """Row counts, sizes and splits that would not fit in the agreement exchange (very
    large jobs) are gathered in the call's move instead: same results."""
    from collectives.api import gather

    monkeypatch.setattr(gather, "PIGGYBACK_BYTES", 0)
    r, n = comm.Get_rank(), comm.Get_size()
    got = C.allgather(np.full((r + 1, 2), r, np.int64))
    assert_equal(got, np.concatenate([np.full((q + 1, 2), q, np.int64) for q in range(n)]),
                 "allgather")
    a, b = C.grouped_allgather([np.full(r + 1, r, np.int32), np.zeros((1, 3), np.int32)])
    assert_equal(a, np.concatenate([np.full(q + 1, q, np.int32) for q in range(n)]), "grouped")
    assert b.shape == (n, 3)
    assert C.allgather_object({"r": r}) == [{"r": q} for q in range(n)]
    rows, received = C.alltoall(np.full(n * (r + 1), r, np.int64), splits=[r + 1] * n)
    assert_equal(rows, np.concatenate([np.full(q + 1, q, np.int64) for q in range(n)]),
                 "alltoall")
    assert received.tolist() == [q + 1 for q in range(n)]
