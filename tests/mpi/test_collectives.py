"""Every collective x algorithm x op x dtype x size x in/out-of-place x NumPy/torch, checked
against a NumPy reference built from mpi4py-gathered inputs, and bit-identical on all ranks."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from conftest import (
    DTYPES,
    OPS,
    assert_broadcast,
    assert_equal,
    assert_gathered,
    assert_reduced,
    assert_same_on_all_ranks,
    assert_scattered,
    make_input,
    rounding_bound,
    run_case,
    skip_unrunnable,
    to_framework,
    to_numpy,
)

import collectives as C

pytestmark = pytest.mark.mpi

ALGOS = list(C.ALGORITHMS)
BIG = (1 << 20) + 1
VARIANTS = [("numpy", False), ("torch", True), ("numpy", True), ("torch", False)]


def counts(n: int) -> list[int]:
    return sorted({0, 1, n - 1, n + 1, 17, 1001}) + [BIG]


def variants(dtype: str, count: int, turn: int = 0) -> list[tuple[str, bool]]:
    """Every variant for small counts; one per call at BIG (rotating with `turn`)."""
    usable = [(f, i) for f, i in VARIANTS if not (dtype == "bfloat16" and f == "numpy")]
    return usable if count < BIG else [usable[turn % len(usable)]]


def seed_of(*parts) -> int:
    """The same seed in every process and run: a CRC of the parts' repr (Python's hash() of
    a str is salted per process)."""
    return zlib.crc32(repr(parts).encode()) % (1 << 31)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ALGOS)
def test_allreduce(comm, algo, dtype):
    n, r = comm.Get_size(), comm.Get_rank()
    for k, op in enumerate(OPS):
        for count in counts(n):
            shape = (count,) if count != 17 else (17, 1)
            for framework, inplace in variants(dtype, count, k):
                what = f"allreduce {algo} {op.name} {dtype} {shape} {framework} inplace={inplace}"
                seed = seed_of(op.name, count, framework, inplace) * 17 + r
                x = to_framework(make_input(dtype, shape, seed), dtype, framework)
                fn = C.allreduce_ if inplace else C.allreduce
                before, got = run_case(lambda t: fn(t, op=op, algorithm=algo), x,  # noqa: B023
                                       inplace, what)
                assert_reduced(comm, got, before, op, dtype, what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ALGOS)
def test_reducescatter(comm, algo, dtype):
    n, r = comm.Get_size(), comm.Get_rank()
    for k, op in enumerate(OPS):
        for rows in counts(n):
            shape = (rows, 3) if rows < BIG else (rows,)
            for framework, _ in variants(dtype, rows, k)[:2]:
                what = f"reducescatter {algo} {op.name} {dtype} {shape} {framework}"
                seed = seed_of("rs", op.name, rows, framework) * 17 + r
                x = to_framework(make_input(dtype, shape, seed), dtype, framework)
                before, got = run_case(lambda t: C.reducescatter(t, op=op, algorithm=algo),  # noqa: B023
                                       x, False, what)
                assert_scattered(comm, got, before, op, dtype, what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ALGOS)
def test_allgather(comm, algo, dtype):
    n, r = comm.Get_size(), comm.Get_rank()
    for count in counts(n):
        for uneven in (False, True):
            rows = count + (r % 2 if uneven else 0)
            shape = (rows, 2) if count < BIG else (rows,)
            for framework, _ in variants(dtype, count, uneven)[:2]:
                what = f"allgather {algo} {dtype} {shape} {framework} uneven={uneven}"
                seed = seed_of("ag", count, uneven, framework) * 17 + r
                x = to_framework(make_input(dtype, shape, seed), dtype, framework)
                before, got = run_case(lambda t: C.allgather(t, algorithm=algo), x,  # noqa: B023
                                       False, what)
                assert_gathered(comm, got, before, what)


@pytest.mark.parametrize("algo", ALGOS)
def test_allgather_into_out(comm, algo):
    """out= receives the result in place (NumPy array or torch tensor, sync and async), and
    is what the call returns."""
    skip_unrunnable(algo)
    n, r = comm.Get_size(), comm.Get_rank()
    for dtype in ("float32", "int64", "bfloat16"):
        for count in counts(n):
            rows = count + r % 2  # uneven
            total = sum(count + q % 2 for q in range(n))
            for framework in ("numpy", "torch") if dtype != "bfloat16" else ("torch",):
                what = f"allgather out= {algo} {dtype} ({rows},) {framework}"
                x = to_framework(make_input(dtype, (rows,), seed_of("ago", count) * 17 + r),
                                 dtype, framework)
                out = to_framework(np.zeros(total, "float64" if dtype == "bfloat16" else dtype),
                                   dtype, framework)
                for sync in (True, False):
                    got = C.allgather(x, algorithm=algo, out=out) if sync else \
                        C.synchronize(C.allgather_async(x, algorithm=algo, out=out))
                    assert got is out, what
                    assert_gathered(comm, to_numpy(out), to_numpy(x), what)
                    out.fill(0) if framework == "numpy" else out.zero_()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ALGOS)
def test_broadcast(comm, algo, dtype):
    n, r = comm.Get_size(), comm.Get_rank()
    for root in sorted({0, n - 1}):
        for count in counts(n):
            for framework, inplace in variants(dtype, count, root):
                what = f"broadcast {algo} root={root} {dtype} ({count},) {framework} inplace={inplace}"
                seed = seed_of("bc", root, count, framework, inplace) * 17 + r
                x = to_framework(make_input(dtype, (count,), seed), dtype, framework)
                fn = C.broadcast_ if inplace else C.broadcast
                before, got = run_case(lambda t: fn(t, root_rank=root, algorithm=algo),  # noqa: B023
                                       x, inplace, what)
                assert_broadcast(comm, got, before, root, what)


@pytest.mark.parametrize("algo", ALGOS)
def test_allreduce_random_floats_bit_identical(comm, algo):
    """Real-valued data: results agree with exact math to the rounding of n - 1 additions in
    the dtype (in whatever order), and bit for bit across ranks (each element is reduced in
    one fixed order)."""
    r, n = comm.Get_rank(), comm.Get_size()
    for dtype in ("float32", "float64"):
        x = np.random.default_rng(100 + r).standard_normal(300001).astype(dtype)
        got = C.allreduce(x, op=C.Sum, algorithm=algo)
        terms = np.stack(comm.allgather(x)).astype(np.float64)
        ref = np.sum(terms, axis=0)  # float64: within n u64 sum|x| of exact, noise here
        bound = rounding_bound(dtype, n - 1, np.sum(np.abs(terms), axis=0)) \
            + rounding_bound("float64", n, np.sum(np.abs(terms), axis=0))
        assert np.all(np.abs(got - ref) <= bound), f"{dtype}: {np.max(np.abs(got - ref))}"
        assert_same_on_all_ranks(comm, got, f"allreduce {algo} {dtype} random")


@pytest.mark.parametrize("algo", ALGOS)
def test_non_contiguous_inputs(comm, algo):
    n = comm.Get_size()
    base = np.arange(40, dtype=np.float32).reshape(8, 5)
    view = base[:, ::2]  # non-contiguous NumPy view
    got = C.allreduce(view, op=C.Sum, algorithm=algo)
    assert_equal(got, view * n, "numpy strided out-of-place")
    C.allreduce_(view, op=C.Sum, algorithm=algo)
    assert_equal(base[:, ::2], np.arange(40, dtype=np.float32).reshape(8, 5)[:, ::2] * n,
                 "numpy strided in-place writes back")
    t = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()  # transposed tensor
    got = C.allreduce(t, op=C.Sum, algorithm=algo)
    assert torch.equal(got, t * n) and got.shape == (4, 3)
    C.allreduce_(t, op=C.Max, algorithm=algo)
    assert torch.equal(t, torch.arange(12, dtype=torch.float64).reshape(3, 4).t())
    g = C.allgather(t, algorithm=algo)
    assert torch.equal(g, torch.cat([t] * n))


@pytest.mark.parametrize("algo", ALGOS)
def test_readonly_and_scalar_inputs(comm, algo):
    n = comm.Get_size()
    x = np.ones(9, dtype=np.int32)
    x.flags.writeable = False
    assert_equal(C.allreduce(x, op=C.Sum, algorithm=algo), np.full(9, n, np.int32), "read-only")
    scalar = torch.tensor(2.5)
    assert C.allreduce(scalar, op=C.Sum, algorithm=algo).item() == 2.5 * n
    assert C.allreduce(np.array(3.0), algorithm=algo).shape == ()
