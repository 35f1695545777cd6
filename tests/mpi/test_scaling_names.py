"""prescale_factor / postscale_factor (Horovod's rounding: in the dtype for float32 and
float64, float32 math for half types, float64 then truncation for integers), name= in
mismatch messages, and allgather_object."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_equal, cast_like, rounding_bound

import collectives as C


def _scaled(x: np.ndarray, dtype: str, factor: float) -> np.ndarray:
    """x * factor as Horovod computes it, as float64 values (bfloat16) or dtype."""
    if dtype in ("float32", "float64"):
        return x * x.dtype.type(factor)
    if dtype in ("float16", "bfloat16"):
        return cast_like(np.asarray(x, np.float32) * np.float32(factor), dtype) \
            if dtype == "bfloat16" else (x.astype(np.float32) * np.float32(factor)).astype(dtype)
    return (x.astype(np.float64) * factor).astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("count", [5, 70000])  # riding in the agreement, and not
def test_prescale_and_postscale(comm, dtype, count):
    n = comm.Get_size()
    rng = np.random.default_rng(5)
    base = rng.integers(-100, 100, count).astype(np.float64)
    x = base if dtype == "bfloat16" else base.astype(dtype)
    factor = 0.37
    tensor = torch.from_numpy(x.copy()).to(getattr(torch, dtype))
    pre = C.allreduce(tensor, op=C.Sum, prescale_factor=factor)
    post = C.allreduce(x.copy() if dtype != "bfloat16" else tensor.clone(), op=C.Sum,
                       postscale_factor=factor)
    as64 = (lambda t: t.to(torch.float64).numpy()) if dtype == "bfloat16" else \
        (lambda t: t.numpy() if isinstance(t, torch.Tensor) else t)
    one = _scaled(x, dtype, factor)
    summed = one
    for _ in range(n - 1):  # every rank holds the same values: n-fold sum of one
        summed = cast_like(np.asarray(summed, np.float64) + np.asarray(one, np.float64), dtype) \
            if dtype in ("float16", "bfloat16") else summed + one
    # floats: the library and the reference each round n - 1 sums and the scaling (or n
    # scalings) of values up to n |x| factor, in another order; integers: exact
    bound = 0 if dtype.startswith("int") else \
        rounding_bound(dtype, 2 * n, n * np.abs(base) * factor)
    assert np.all(np.abs(as64(pre) - np.asarray(summed, np.float64)) <= bound), "prescale"
    total = np.asarray(x, np.float64) * n
    expected_post = _scaled(total if dtype == "bfloat16" else total.astype(dtype), dtype, factor)
    assert np.all(np.abs(as64(post) - np.asarray(expected_post, np.float64)) <= bound), \
        "postscale"
    if dtype.startswith("int"):  # exact: truncation toward zero after the float64 product
        assert_equal(as64(post), expected_post, "integer postscale")
    # in place, grouped, reducescatter: the same factors
    y = x.copy() if dtype != "bfloat16" else tensor.clone()
    C.allreduce_(y, op=C.Sum, prescale_factor=factor)
    np.testing.assert_allclose(as64(y), as64(pre), rtol=0, atol=0)
    g = C.grouped_allreduce([tensor, tensor[:3]], op=C.Sum, postscale_factor=factor)
    np.testing.assert_allclose(as64(g[0]), as64(post), rtol=0, atol=0)
    if dtype != "bfloat16":
        assert_equal(x, base.astype(dtype), "the input is untouched")


def test_scale_factors_are_agreed_and_checked(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    with pytest.raises(TypeError, match="prescale_factor: expected a number, got str"):
        C.allreduce(np.ones(3), prescale_factor="2")
    if n > 1:
        with pytest.raises(C.MismatchError, match="postscale_factor"):
            C.allreduce(np.ones(3), postscale_factor=2.0 if r == 0 else 3.0)
    part = C.reducescatter(np.ones((n, 2)), op=C.Sum, prescale_factor=0.5, postscale_factor=4.0)
    assert_equal(part, np.full((1, 2), 2.0 * n), "reducescatter scaled")
    got = C.grouped_reducescatter([np.ones((n, 2), np.float32)], op=C.Sum, postscale_factor=0.5)
    assert_equal(got[0], np.full((1, 2), n / 2, np.float32), "grouped_reducescatter scaled")


def test_names_appear_in_mismatch_messages(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    assert_equal(C.allreduce(np.ones(3), op=C.Sum, name="loss"), np.full(3, float(n)), "named")
    C.barrier(name="epoch end")
    if n == 1:
        return
    with pytest.raises(C.MismatchError, match=r"allreduce name mismatch: rank 0 has 'a'"):
        C.allreduce(np.ones(3), name="a" if r == 0 else "b")
    with pytest.raises(C.MismatchError, match=r"dtype mismatch.*"):
        C.allgather(np.ones(2, np.float32 if r == 0 else np.float64), name="grads")
    with pytest.raises(TypeError, match="name: expected a str, got int"):
        C.broadcast(np.ones(2), name=3)


def test_allgather_object(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    obj = {"metric": r} if r != 1 else {"metric": 1, "extra": [42] * 5000}
    got = C.allgather_object(obj)
    expected = [{"metric": q} for q in range(n)]
    if n > 1:
        expected[1] = {"metric": 1, "extra": [42] * 5000}
    assert got == expected
    with pytest.raises(ValueError, match="obj: cannot be pickled"):
        C.allgather_object(lambda: None if r == 0 else 1)
    assert C.allgather_object(None) == [None] * n
