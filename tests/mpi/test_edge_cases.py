"""NaN/Inf, unaligned and odd inputs, concurrent threads, and property-based sweeps."""

from __future__ import annotations

import threading

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
    split_rows,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives as C

pytestmark = pytest.mark.mpi
ALGOS = list(C.ALGORITHMS)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algo", ALGOS)
def test_nan_and_inf_follow_ieee(comm, algo):
    r, n = comm.Get_rank(), comm.Get_size()
    x = np.array([1.0, 2.0, np.inf, 5.0, 0.0], np.float32)
    if r == 0:
        x[0] = np.nan
        x[2] = -np.inf  # inf + -inf = nan
    if r == n - 1:
        x[3] = np.inf
    got = C.allreduce(x, op=C.Sum, algorithm=algo)
    assert np.isnan(got[0]) and got[1] == 2.0 * n and np.isnan(got[2]) and got[3] == np.inf
    for op in (C.Min, C.Max):  # NaN wins in Min and Max, as numpy.minimum/maximum
        got = C.allreduce(x, op=op, algorithm=algo)
        assert np.isnan(got[0]), (op, got)
        assert_same_on_all_ranks(comm, got, f"{algo} {op.name} with nan")


@pytest.mark.parametrize("algo", ALGOS)
def test_unaligned_views(comm, algo):
    n = comm.Get_size()
    raw = bytearray(4 * 1001 + 1)
    x = np.frombuffer(raw, dtype=np.float32, offset=1)
    assert not x.flags.aligned
    x[:] = 1.5
    assert np.all(C.allreduce(x, op=C.Sum, algorithm=algo) == 1.5 * n)
    C.allreduce_(x, op=C.Sum, algorithm=algo)
    assert np.all(x == 1.5 * n)
    assert C.allgather(x[:3], algorithm=algo).shape == (3 * n,)


def test_calls_from_several_threads(comm):
    """Collectives from many threads are serialized in each rank's submission order; ranks
    may order them differently, so each call either succeeds or raises MismatchError (never
    hangs, never mixes data): all threads' calls pair up one-for-one across ranks."""
    n = comm.Get_size()
    outcomes: list[str] = []

    def worker(tid: int) -> None:
        for _ in range(10):
            x = np.full(tid + 1, float(tid))
            try:
                y = C.allreduce(x, op=C.Sum)
                assert np.all(y == tid * n), (tid, y)
                outcomes.append("ok")
            except C.MismatchError:
                outcomes.append("mismatch")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 40
    assert np.all(C.allreduce(np.ones(3), op=C.Sum) == n)  # still in step afterwards


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(algo=st.sampled_from(ALGOS), dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS),
       rows=st.integers(0, 40), cols=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_property_allreduce_and_reducescatter(algo, dtype, op, rows, cols, seed):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    r, n = comm.Get_rank(), comm.Get_size()
    a = make_input(dtype, (rows, cols), seed * 31 + r)
    x = torch.from_numpy(a).to(torch.bfloat16) if dtype == "bfloat16" else a
    inputs = comm.allgather(a if dtype != "bfloat16" else x.to(torch.float64).numpy())
    expected = reference_reduce(inputs, op, dtype, n)
    got = C.allreduce(x, op=op, algorithm=algo)
    got = got.to(torch.float64).numpy() if dtype == "bfloat16" else got
    assert_equal(got, expected, f"allreduce {algo} {dtype} {op.name} {(rows, cols)}")
    part = C.reducescatter(x, op=op, algorithm=algo)
    part = part.to(torch.float64).numpy() if dtype == "bfloat16" else part
    cut = split_rows(rows, n)
    assert_equal(part, expected[cut[r]:cut[r + 1]], f"reducescatter {algo} {dtype}")


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(algo=st.sampled_from(ALGOS), dtype=st.sampled_from(["float32", "int8", "float64"]),
       rows=st.lists(st.integers(0, 9), min_size=8, max_size=8), root=st.integers(0, 7),
       seed=st.integers(0, 2**16))
def test_property_allgather_and_broadcast(algo, dtype, rows, root, seed):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    r, n = comm.Get_rank(), comm.Get_size()
    x = make_input(dtype, (rows[r], 2), seed + r)
    assert_equal(C.allgather(x, algorithm=algo), np.concatenate(comm.allgather(x)), "allgather")
    root %= n
    y = make_input(dtype, (rows[0], 3), seed + r)
    assert_equal(C.broadcast(y, root_rank=root, algorithm=algo), comm.bcast(y, root=root),
                 "broadcast")
