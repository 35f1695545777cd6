"""Average's rule, on every algorithm: each element is its Sum divided once by the ranks
that contributed (floor division for integers), so an Average has the bits of the same
call's Sum divided afterwards, on every rank alike. Algorithms that fold the division into
their reduction (each rank dividing what it reduces: ring, shm, hierarchical) must keep
that rule; inputs whose sums round (random floats) make a division before the last fold,
or a rank dividing a different sum, show up in the bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_equal, assert_same_on_all_ranks, skip_unrunnable

import collectives as C

pytestmark = pytest.mark.mpi

#: `auto` is left out: its online trials run different algorithms call by call.
ALGOS = [a for a in C.ALGORITHMS if a != "auto"]
DTYPES = ["float32", "float64", "int32", "int64"]
#: Past shm's single step (SMALL_BYTES over the ranks) at np 2, so its pipeline runs too.
PIPELINED = 70_001


def counts(n: int) -> list[int]:
    return sorted({0, 1, n - 1, n + 1, 1001, PIPELINED})


def _input(dtype: str, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.startswith("int"):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=count, dtype=dtype, endpoint=True)
    return (rng.standard_normal(count) * 1000).astype(dtype)


def _divided(total: np.ndarray, n: int) -> np.ndarray:
    if total.dtype.kind == "i":
        return np.floor_divide(total, np.array(n, dtype=total.dtype))
    return total / total.dtype.type(n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ALGOS)
def test_average_is_the_sum_divided_once(comm, algorithm, dtype):
    n, r = comm.Get_size(), comm.Get_rank()
    skip_unrunnable(algorithm)
    for count in counts(n):
        for framework in ("numpy", "torch"):
            for inplace in (False, True):
                what = f"{algorithm} {dtype} {count} {framework} in place={inplace}"
                x = _input(dtype, count, seed=r * 7919 + count)
                total = C.allreduce(x, op=C.Sum, algorithm=algorithm)
                want = _divided(total, n)
                for turn in range(2):  # the second call takes a fast entry where one exists
                    y = x.copy() if framework == "numpy" else torch.from_numpy(x.copy())
                    if inplace:
                        got = C.allreduce_(y, op=C.Average, algorithm=algorithm)
                        assert got is y, what
                    else:
                        got = C.allreduce(y, op=C.Average, algorithm=algorithm)
                        assert_equal(np.asarray(y), x, f"{what}: input modified")
                    got = np.asarray(got)
                    assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), \
                        f"{what} call {turn}: not the Sum divided once"
                    assert_same_on_all_ranks(comm, got, what)
