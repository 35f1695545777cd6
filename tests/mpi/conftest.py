"""Shared helpers for tests run under mpirun (every rank runs the same test in order)."""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from mpi4py import MPI

import collectives as C

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "int16"]
OPS = [C.Sum, C.Average, C.Min, C.Max, C.Product]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails on one rank ends the whole job at once (MPI_Abort, after printing
    the failure): otherwise the other ranks would wait in their next collective, or in a
    collective teardown, until the outer timeout."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        sys.stderr.write(f"\nrank {MPI.COMM_WORLD.Get_rank()}: {item.nodeid} failed "
                         f"({report.when}):\n{report.longreprtext}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture(scope="session", autouse=True)
def initialized():
    C.init()
    yield


@pytest.fixture
def comm() -> MPI.Comm:
    """An independent communicator for building references (not the library's own)."""
    return MPI.COMM_WORLD


#: The longest a test waits for a state another thread or rank makes before the wait
#: counts as a hang.
WAIT_S = 60.0


def until(done: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll done() until it holds; fail naming what, past timeout_s (a hang, not a slow
    machine: nothing here is timed). The one wait of this suite that sleeps: between polls."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.0005)


def unit_roundoff(dtype) -> float:
    """u: the largest relative error of one rounding to dtype (half its machine epsilon):
    2**-24 for float32, 2**-53 for float64, 2**-11 for float16, 2**-8 for bfloat16."""
    name = str(dtype).removeprefix("torch.")
    return 2.0 ** -8 if name == "bfloat16" else float(np.finfo(name).eps) / 2


def rounding_bound(dtype, roundings: float, magnitude):
    """How far a value computed in dtype can lie from exact arithmetic, to first order:
    roundings (the longest chain of roundings any element passes through: k - 1 for a sum
    of k terms, in whatever order a kernel adds them) times u times magnitude (the sum of
    the absolute values of what was added, or a bound on it). Tolerances of results that
    the CPU's SIMD paths compute in another order come from this, not from one machine's
    observed differences."""
    return roundings * unit_roundoff(dtype) * magnitude


#: A few steps of a small float32 model trained by ranks on their shards, against one
#: process on the whole batch: every gradient's sums run in another order (and through
#: whichever SIMD kernels torch picks), each off by at most (terms - 1) roundings of its
#: terms' size (<= 16 features, <= 16 rows here); the optimizer carries a few steps of them,
#: and each update rounds the parameter once. That stays within 168 roundings (u = 2**-24)
#: of a parameter's size, 17 of them where it is near zero: rtol 1.0e-5, atol 1.0e-6. An
#: error of the algorithm (a rank's gradient lost or counted twice) is >= 1e-3.
FLOAT32_TRAINING = {"rtol": 168 * unit_roundoff("float32"), "atol": 17 * unit_roundoff("float32")}


def make_input(dtype: str, shape: tuple, seed: int) -> np.ndarray:
    """Deterministic data on which every op is exact: full-range integers (sums and
    products wrap identically everywhere) and small integer-valued floats."""
    rng = np.random.default_rng(seed)
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    values = rng.integers(-4, 5, size=shape).astype(np.float64)
    return values if dtype == "bfloat16" else values.astype(dtype)


def to_framework(a: np.ndarray, dtype: str, framework: str):
    """a (float64 for bfloat16) as a NumPy array or torch tensor of dtype."""
    if framework == "numpy":
        return a.copy()
    return torch.from_numpy(a.copy()).to(getattr(torch, dtype))


def to_numpy(x) -> np.ndarray:
    """Any result as a NumPy array of float64 (bf16/f16) or its own dtype, for comparison."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            return x.to(torch.float64).numpy()
        return x.numpy()
    return x


def cast_like(ref64: np.ndarray, dtype: str) -> np.ndarray:
    """A float64 / wrapped-integer reference rounded to dtype the way the library rounds."""
    if dtype == "bfloat16":
        return torch.from_numpy(ref64).to(torch.bfloat16).to(torch.float64).numpy()
    return ref64.astype(dtype)


def reference_reduce(inputs: list[np.ndarray], op, dtype: str, n: int) -> np.ndarray:
    """Independent NumPy reduction of every rank's input (gathered with mpi4py)."""
    if dtype.startswith(("int", "uint")):
        stack = np.stack(inputs)
        if op in (C.Sum, C.Average):
            out = np.sum(stack, axis=0, dtype=dtype)
            return np.floor_divide(out, np.array(n, dtype=dtype)) if op is C.Average else out
        if op is C.Product:
            return np.prod(stack, axis=0, dtype=dtype)
        return (np.min if op is C.Min else np.max)(stack, axis=0)
    stack = np.stack([np.asarray(i, dtype=np.float64) for i in inputs])
    ref = {C.Sum: np.sum, C.Product: np.prod, C.Min: np.min, C.Max: np.max,
           C.Average: np.sum}[op](stack, axis=0)
    if op is C.Average:
        ref = ref / n
    return cast_like(ref, dtype)


def skip_unrunnable(algo: str) -> None:
    """Skip the test where algo cannot run on this job's layout (algorithms.check)."""
    from collectives import algorithms
    from collectives.runtime import topology

    try:
        algorithms.check(algo, topology.get())
    except ValueError:
        pytest.skip(f"{algo} cannot run on this layout")


def assert_same_on_all_ranks(comm: MPI.Comm, result: np.ndarray, what: str) -> None:
    """Every rank's result is bit-identical (digest of its shape, dtype and raw bytes)."""
    digest = hashlib.sha256(repr((result.shape, result.dtype.str)).encode()
                            + np.ascontiguousarray(result).tobytes()).hexdigest()
    digests = comm.allgather(digest)
    assert len(set(digests)) == 1, f"{what}: results differ across ranks: {digests}"


def split_rows(rows: int, n: int) -> list[int]:
    """The row boundaries of n near-equal parts, the larger first (reducescatter's split)."""
    base, extra = divmod(rows, n)
    return [i * base + min(i, extra) for i in range(n + 1)]


def assert_reduced(comm: MPI.Comm, result: np.ndarray, before: np.ndarray, op, dtype: str,
                   what: str) -> None:
    """result, the same on every rank, is the reduction of every rank's `before`. Each rank
    checks its share of the rows against the reference of that share (every rank's rows of
    it, sent by alltoall) and the ranks' digests agree: every element is checked, and the
    reference costs its whole once in the job, not once per rank. (The exchanges come
    first, so that a rank's failed check leaves no other waiting in one.)"""
    n, r = comm.Get_size(), comm.Get_rank()
    cut = split_rows(len(before), n)
    parts = comm.alltoall([before[cut[j]:cut[j + 1]] for j in range(n)])
    assert_same_on_all_ranks(comm, result, what)
    assert result.shape == before.shape, f"{what}: shape {result.shape} != {before.shape}"
    assert_equal(result[cut[r]:cut[r + 1]], reference_reduce(parts, op, dtype, n), what)


def assert_scattered(comm: MPI.Comm, result: np.ndarray, before: np.ndarray, op, dtype: str,
                     what: str) -> None:
    """result is this rank's rows (split_rows) of the reduction of every rank's `before`,
    against the reference of those rows only (every rank's rows of them, by alltoall)."""
    n = comm.Get_size()
    cut = split_rows(len(before), n)
    parts = comm.alltoall([before[cut[j]:cut[j + 1]] for j in range(n)])
    assert_equal(result, reference_reduce(parts, op, dtype, n), what)


def assert_gathered(comm: MPI.Comm, result: np.ndarray, before: np.ndarray, what: str) -> None:
    """result, the same on every rank, is every rank's `before` in rank order: each rank
    finds its own rows where the ranks' row counts put them, and the digests agree."""
    rows = comm.allgather(len(before))
    start = sum(rows[:comm.Get_rank()])
    assert_same_on_all_ranks(comm, result, what)
    assert len(result) == sum(rows), f"{what}: {len(result)} rows, expected {sum(rows)}"
    assert_equal(result[start:start + len(before)], before, what)


def assert_broadcast(comm: MPI.Comm, result: np.ndarray, before: np.ndarray, root: int,
                     what: str) -> None:
    """result, the same on every rank, is the root's `before`: the digests agree, and the
    root compares."""
    assert_same_on_all_ranks(comm, result, what)
    if comm.Get_rank() == root:
        assert_equal(result, before, what)


def assert_equal(result: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert result.shape == expected.shape, f"{what}: shape {result.shape} != {expected.shape}"
    same = (result == expected) | (np.isnan(result) & np.isnan(expected)
                                   if result.dtype.kind == "f" else False)
    if not np.all(same):
        bad = np.argwhere(~same)[:5].tolist()
        raise AssertionError(f"{what}: {int((~same).sum())} wrong elements, first at {bad}: "
                             f"got {result[tuple(np.array(bad).T)]}, "
                             f"expected {expected[tuple(np.array(bad).T)]}")


def run_case(call, x, inplace: bool, what: str, host=to_numpy) -> tuple[np.ndarray, np.ndarray]:
    """(x before, call(x)) as host arrays, after checking the call's contract: in place, the
    input returned; out of place, the input untouched and a result of its type and dtype."""
    before = host(x).copy()
    y = call(x)
    if inplace:
        assert y is x, f"{what}: in-place call must return its input"
    else:
        assert_equal(host(x), before, f"{what}: input modified")
        assert type(y) is type(x), f"{what}: result type {type(y)} != {type(x)}"
        assert y.dtype == x.dtype, f"{what}: result dtype {y.dtype} != {x.dtype}"
    return before, host(y)
