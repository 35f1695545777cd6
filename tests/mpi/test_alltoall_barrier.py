"""alltoall (pairwise, mpi, auto) and barrier against independent references."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DTYPES, assert_equal, assert_same_on_all_ranks, make_input, to_framework

import collectives as C
from collectives import algorithms


def _splits(r: int, n: int, case: str) -> list[int]:
    """Rows rank r sends to each rank: every pattern, zeros included."""
    if case == "even":
        return [3] * n
    if case == "ragged":
        return [(r + 2 * j) % 4 for j in range(n)]
    return [0] * (n - 1) + [5] if r % 2 else [1] * n  # "zeros": some ranks get nothing


@pytest.mark.parametrize("algo", list(algorithms.ALLTOALL_ALGORITHMS))
@pytest.mark.parametrize("case", ["even", "ragged", "zeros"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_matches_a_reference(comm, algo, case, dtype):
    r, n = comm.Get_rank(), comm.Get_size()
    mine = _splits(r, n, case)
    rows = sum(mine)
    data = make_input(dtype, (rows, 3), seed=100 * r + len(case))
    everyone = comm.allgather((data, mine))
    # rank r receives, from each j in order, j's rows destined for r
    parts = []
    for data_j, splits_j in everyone:
        start = sum(splits_j[:r])
        parts.append(data_j[start:start + splits_j[r]])
    expected = np.concatenate(parts)
    for framework in ("numpy", "torch"):
        if framework == "numpy" and dtype == "bfloat16":
            continue
        x = to_framework(data, dtype, framework)
        if case == "even":
            got = C.alltoall(x, algorithm=algo)
        else:
            got, received = C.alltoall(x, splits=mine, algorithm=algo)
            assert list(np.asarray(received)) == [s[r] for _, s in everyone]
        got_np = got.to(torch.float64).numpy() if framework == "torch" and dtype == "bfloat16" \
            else np.asarray(got)
        ref = expected.astype(np.float64) if dtype == "bfloat16" else expected.astype(dtype)
        assert_equal(got_np, torch.from_numpy(ref).to(torch.bfloat16).to(torch.float64).numpy()
                     if dtype == "bfloat16" else ref, f"{algo} {case} {dtype} {framework}")


def test_alltoall_async_and_splits_of_any_int_kind(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    x = np.arange(2 * n * 2, dtype=np.float32).reshape(2 * n, 2) + 100 * r
    h = C.alltoall_async(x)
    got = C.synchronize(h)
    assert got.shape == (2 * n, 2)
    assert_equal(got[:2], np.arange(2 * r * 2, 2 * r * 2 + 4, dtype=np.float32).reshape(2, 2),
                 "from rank 0")
    for splits in ([2] * n, np.full(n, 2), torch.full((n,), 2)):
        same, _ = C.alltoall(x, splits=splits)
        assert_equal(same, got, "splits kinds")


def test_alltoall_errors_name_the_argument(comm):
    n = comm.Get_size()
    x = np.zeros((n + 1, 2))
    if n > 1:
        with pytest.raises(ValueError, match="divisible"):
            C.alltoall(x)
    for bad in ([1] * (n + 1), [-1] + [1] * (n - 1), [0.5] * n, "ab", 3):
        with pytest.raises(ValueError, match="splits"):
            C.alltoall(x, splits=bad)
    with pytest.raises(ValueError, match="algorithm"):
        C.alltoall(np.zeros((n, 2)), algorithm="ring")
    with pytest.raises(ValueError, match="dimension"):
        C.alltoall(np.array(1.0))


def test_barrier_waits_for_every_rank(comm, tmp_path_factory):
    """The last rank arrives late, leaving a mark just before; every rank finds it after
    the barrier (a barrier that let a rank through early would check before it is made)."""
    r, n = comm.Get_rank(), comm.Get_size()
    mark = Path(comm.bcast(str(tmp_path_factory.mktemp("barrier")) if r == 0 else None), "arrived")
    comm.Barrier()
    if r == n - 1:
        time.sleep(0.3)
        mark.touch()
    C.barrier()
    assert mark.exists(), "left the barrier before the last rank arrived"
    assert_same_on_all_ranks(comm, np.array([1]), "after barrier")


@pytest.mark.mpi(min_size=2)
def test_barrier_against_another_collective_raises_everywhere(comm):
    r = comm.Get_rank()
    with pytest.raises(C.MismatchError, match="collective mismatch"):
        if r == 0:
            C.barrier()
        else:
            C.allreduce(np.ones(2))
    C.barrier()
