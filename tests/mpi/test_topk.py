"""Top-K compression with error feedback (collectives/compression/topk.py): each result is
bit for bit the one of a NumPy reference that follows every rank's residual over several
calls (its own selection by a stable sort, not the kernel's partial selection); every rank
gets the same bits; the residual is the compressor's, carried across calls, saved and
restored; other dtypes, torch tensors, in place and async give the same bits; non-floating
data is never compressed; bad ratios and a compressor reused on another vector are clear
errors on every rank, before anything is agreed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from collectives.optim import DistributedOptimizer
from conftest import assert_equal, assert_same_on_all_ranks, split_rows

import collectives as C

f32 = np.float32


def inputs(n: int, count: int, seed: int) -> list[np.ndarray]:
    """Every rank's input for one call (rank r's magnitude 1 + r), with ties: whole halves."""
    return [(np.random.default_rng(seed * 100 + r).integers(-40, 41, count) / 2 * (1 + r))
            .astype(f32) for r in range(n)]


def k_of(count: int, ratio: float) -> int:
    return min(count, max(1, math.ceil(ratio * count))) if count else 0


class Reference:
    """Every rank's residual (and momentum, DGC's momentum correction: what is sent leaves
    both), and the result each call must give."""

    def __init__(self, n: int, count: int, ratio: float, momentum: float = 0.0):
        self.residuals = [np.zeros(count, f32) for _ in range(n)]
        self.velocities = [np.zeros(count, f32) for _ in range(n)]
        self.ratio, self.momentum = ratio, f32(momentum)

    def call(self, xs: list[np.ndarray], average: bool, ratio: float | None = None) -> np.ndarray:
        total = np.zeros(xs[0].size, f32)
        k = k_of(xs[0].size, self.ratio if ratio is None else ratio)
        for r, x in enumerate(xs):  # rank order
            u = x
            if self.momentum:
                u = self.velocities[r] = (self.velocities[r] * self.momentum + x).astype(f32)
            c = (u + self.residuals[r]).astype(f32)
            magnitude = np.where(np.isnan(c), np.inf, np.abs(c))
            chosen = np.sort(np.argsort(-magnitude, kind="stable")[:k])
            total[chosen] = (total[chosen] + c[chosen]).astype(f32)
            c[chosen] = 0
            self.velocities[r][chosen] = 0
            self.residuals[r] = c
        return total / f32(len(xs)) if average else total


def counts(n: int) -> list[int]:
    return sorted({0, 1, max(n - 1, 1), 7, 1000, 4099})


@pytest.mark.parametrize("ratio", [0.01, 0.3, 1.0])
@pytest.mark.parametrize("op", [C.Sum, C.Average])
def test_calls_give_the_references_bits_and_carry_the_residual(comm, ratio, op):
    n, r = comm.Get_size(), comm.Get_rank()
    for count in counts(n):
        compressor, reference = C.Compression.topk(ratio), Reference(n, count, ratio)
        for call in range(3):  # the residual carried from one call to the next
            xs = inputs(n, count, 10 * count + call)
            x = xs[r].copy()
            got = C.allreduce(x, op=op, compression=compressor)
            expected = reference.call(xs, op is C.Average)
            what = f"topk {ratio} {op.name} of {count}, call {call}"
            assert got.dtype == np.float32 and got.shape == (count,), what
            assert_equal(got, expected, what)
            assert_equal(x, xs[r], "x")
            assert_equal(compressor.residual, reference.residuals[r], f"{what}: residual")
            assert_same_on_all_ranks(comm, got, what)


def warmup_ratios(ratio: float, steps: int, calls: int) -> list[float]:
    """DGC's warm-up as the reference computes it: from a quarter, geometric to ratio."""
    return [max(ratio, 0.25 * (ratio / 0.25) ** (t / steps)) if t < steps else ratio
            for t in range(calls)]


@pytest.mark.parametrize("momentum,warmup", [(0.9, 0), (0.0, 3), (0.5, 2)])
def test_momentum_correction_and_warmup_give_the_references_bits(comm, momentum, warmup):
    """DGC's options: each call's result, residual and momentum are the reference's, the
    k of each call that of the warm-up's ratio for it; the calls are made two at a time,
    async, so each call's ratio is the one bound when it was made."""
    n, r = comm.Get_size(), comm.Get_rank()
    ratios = warmup_ratios(0.01, warmup, 6)
    assert warmup == 0 or ratios[0] == 0.25 > ratios[warmup - 1] > ratios[warmup] == 0.01
    for count in counts(n):
        compressor = C.Compression.topk(0.01, momentum=momentum, warmup_steps=warmup)
        reference = Reference(n, count, 0.01, momentum)
        for call in range(0, 6, 2):
            xs = [inputs(n, count, 10 * count + call + j) for j in (0, 1)]
            handles = [C.allreduce_async(x[r].copy(), op=C.Average, compression=compressor)
                       for x in xs]
            for j, h in enumerate(handles):
                what = f"topk momentum {momentum} warm-up {warmup} of {count}, call {call + j}"
                got = C.synchronize(h)
                assert_equal(got, reference.call(xs[j], True, ratios[call + j]), what)
                assert_same_on_all_ranks(comm, got, what)
            assert_equal(compressor.residual, reference.residuals[r], f"{what}: residual")
            if momentum:
                assert_equal(compressor.velocity, reference.velocities[r], f"{what}: momentum")
            else:
                assert compressor.velocity is None


def test_the_state_dict_carries_the_momentum_and_the_warmups_clock(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    first, count = C.Compression.topk(0.05, momentum=0.9, warmup_steps=4), 200
    for call in range(2):
        C.allreduce(inputs(n, count, call)[r], compression=first)
    second = C.Compression.topk(0.05, momentum=0.9, warmup_steps=4)
    second.load_state_dict(first.state_dict())
    for call in range(2, 5):  # through the end of the warm-up
        xs = inputs(n, count, call)
        assert_equal(C.allreduce(xs[r], compression=second),
                     C.allreduce(xs[r], compression=first), f"restored, call {call}")
    for other in (C.Compression.topk(0.05, momentum=0.5, warmup_steps=4),
                  C.Compression.topk(0.05, momentum=0.9)):
        with pytest.raises(ValueError, match="momentum, warmup_steps"):
            other.load_state_dict(first.state_dict())


@pytest.mark.parametrize("momentum", [1.0, -0.1, True, "0.9", float("nan")])
def test_a_bad_momentum_is_refused_naming_it(momentum):
    with pytest.raises(ValueError, match=r"momentum: expected a number in \[0, 1\)"):
        C.Compression.topk(0.01, momentum=momentum)


@pytest.mark.parametrize("steps", [-1, 1.5, True, None])
def test_a_bad_warmup_is_refused_naming_it(steps):
    with pytest.raises(ValueError, match="warmup_steps: expected an int >= 0"):
        C.Compression.topk(0.01, warmup_steps=steps)


def test_momentum_correction_refuses_an_optimizer_with_momentum_of_its_own():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="corrects the momentum itself"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             compression=C.Compression.topk(0.01, momentum=0.9))
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                         compression=C.Compression.topk(0.01, momentum=0.9))


def test_what_was_sent_and_the_residual_add_up_to_the_inputs(comm):
    """Over calls, n times the average of what was sent plus every rank's residual is the
    sum of every rank's inputs (exact here: small whole numbers add exactly in float32)."""
    n, r = comm.Get_size(), comm.Get_rank()
    compressor, count = C.Compression.topk(0.05), 300
    sent, inputs_sum = np.zeros(count, f32), np.zeros(count, f32)
    for call in range(6):
        xs = [np.random.default_rng(call * 10 + q).integers(-8, 9, count).astype(f32)
              for q in range(n)]
        sent += C.allreduce(xs[r], op=C.Sum, compression=compressor)
        inputs_sum += sum(xs)
    residuals = comm.allreduce(compressor.residual.astype(np.float64))
    assert_equal((sent + residuals).astype(f32), inputs_sum, "sent + residuals")


def test_a_nan_is_sent_not_held_back(comm):
    x = np.ones(50, f32)
    x[17] = np.nan
    got = C.allreduce(x, op=C.Sum, compression=C.Compression.topk(0.02))  # k = 1
    assert np.isnan(got[17]) and np.count_nonzero(~np.isnan(got) & (got != 0)) == 0, got


def test_the_state_dict_restores_the_residual(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    first, count = C.Compression.topk(0.1), 200
    C.allreduce(inputs(n, count, 1)[r], compression=first)
    saved = first.state_dict()
    second = C.Compression.topk(0.1)
    second.load_state_dict(saved)
    xs = inputs(n, count, 2)
    assert_equal(C.allreduce(xs[r], compression=second), C.allreduce(xs[r], compression=first),
                 "restored")
    with pytest.raises(ValueError, match="ratio"):
        C.Compression.topk(0.2).load_state_dict(saved)


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_other_dtypes_give_the_float32_result_cast(comm, dtype):
    n, r = comm.Get_size(), comm.Get_rank()
    xs = inputs(n, 700, 3)
    got = C.allreduce(xs[r].astype(dtype), op=C.Sum, compression=C.Compression.topk(0.1))
    expected = Reference(n, 700, 0.1).call(xs, False)
    assert got.dtype == np.dtype(dtype)
    assert_equal(got, expected.astype(dtype), dtype)


def test_in_place_torch_async_and_grouped_give_the_same_bits(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    xs = inputs(n, 2000, 5)
    got = C.allreduce(xs[r], op=C.Average, compression=C.Compression.topk(0.05))
    t = torch.from_numpy(xs[r].copy()).reshape(40, 50)
    C.allreduce_(t, op=C.Average, compression=C.Compression.topk(0.05))
    assert_equal(t.reshape(-1).numpy(), got, "in place, torch")
    handle = C.allreduce_async(torch.from_numpy(xs[r]), op=C.Average,
                               compression=C.Compression.topk(0.05))
    assert_equal(C.synchronize(handle).numpy(), got, "async")
    halves = C.grouped_allreduce([xs[r][:1200], xs[r][1200:]], op=C.Average,
                                 compression=C.Compression.topk(0.05))
    assert_equal(np.concatenate(halves), got, "grouped (one fused vector)")
    ints = np.arange(6, dtype=np.int32) + r
    compressor = C.Compression.topk(0.5)
    assert_equal(C.allreduce(ints, op=C.Sum, compression=compressor),
                 sum(np.arange(6, dtype=np.int32) + q for q in range(n)), "int32 untouched")
    assert compressor.residual is None


def test_reducescatter_gives_this_ranks_block_of_the_allreduce(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    xs = [x.reshape(-1, 10) for x in inputs(n, 10 * (2 * n + 1), 4)]
    got = C.reducescatter(xs[r], op=C.Sum, compression=C.Compression.topk(0.2))
    whole = Reference(n, xs[0].size, 0.2).call([x.reshape(-1) for x in xs], False)
    bounds = split_rows(2 * n + 1, n)
    assert_equal(got.reshape(-1), whole[bounds[r] * 10:bounds[r + 1] * 10], "my rows")


@pytest.mark.parametrize("ratio", [0, -0.1, 1.5, float("nan"), True, "0.1", None])
def test_a_bad_ratio_is_refused_naming_it(ratio):
    with pytest.raises(ValueError, match="ratio: expected a number in"):
        C.Compression.topk(ratio)


def test_a_compressor_reused_on_another_vector_is_refused_on_every_rank(comm):
    compressor = C.Compression.topk(0.1)
    C.allreduce(np.ones(100, f32), compression=compressor)
    with pytest.raises(ValueError, match="residual of a vector of 100 elements, got 50"):
        C.allreduce(np.ones(50, f32), compression=compressor)
    with pytest.raises(ValueError, match="supports"):
        C.allreduce(np.ones(100, f32), op=C.Max, compression=compressor)
    # the job goes on: nothing was agreed
    assert_equal(C.allreduce(np.ones(3, f32), op=C.Sum), np.full(3, comm.Get_size(), f32),
                 "after")


def test_distributed_optimizer_reduces_each_bucket_with_its_own_residual(comm):
    """Two parameters in two buckets (a threshold of one byte): each bucket's gradient is
    the reference's with its own residual, step after step; the state dict carries the
    residuals to a new optimizer on the same rank."""
    n, r = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       compression=C.Compression.topk(0.25),
                                       fusion_threshold_bytes=1)
    references = {"weight": Reference(n, 18, 0.25), "bias": Reference(n, 3, 0.25)}
    for step in range(4):
        if step == 2:  # a new optimizer from the state dict goes on with the residuals
            saved = opt.state_dict()
            opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               compression=C.Compression.topk(0.25),
                                               fusion_threshold_bytes=1)
            opt.load_state_dict(saved)
        twin = torch.nn.Linear(6, 3)  # every rank's gradients, outside the optimizer's hooks
        twin.load_state_dict(model.state_dict())
        everyone: dict[str, list[np.ndarray]] = {name: [] for name in references}
        for q in range(n):
            g = torch.Generator().manual_seed(step * 100 + q)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            twin.zero_grad()
            ((twin(x) - y) ** 2).sum().backward()
            for name in references:
                everyone[name].append(getattr(twin, name).grad.reshape(-1).numpy().copy())
        expected = {name: references[name].call(everyone[name], True) for name in references}
        g = torch.Generator().manual_seed(step * 100 + r)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).sum().backward()
        opt.synchronize()
        for name, want in expected.items():
            assert_equal(getattr(model, name).grad.reshape(-1).numpy(), want, f"{name} {step}")
        with opt.skip_synchronize():
            opt.step()
    assert_same_on_all_ranks(comm, model.weight.detach().numpy(), "weights")
