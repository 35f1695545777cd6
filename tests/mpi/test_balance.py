"""The batch-share balancer: shares follow each rank's measured speed (one rank slowed on
purpose by a delay per sample, on the balancer's clock: _Clock), stay equal on equal
ranks, every global batch dealt whole with no index lost or repeated, and the parameters
(DistributedOptimizer, DDP with a timed hook, ZeroOptimizer stage 2, OnebitAdam) equal a
float64 one-process replay of the global batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from collectives.optim import (
    BalancedSampler,
    Balancer,
    DistributedOptimizer,
    OnebitAdam,
    ZeroOptimizer,
    balance,
    broadcast_parameters,
)
from collectives.optim.balance import proportional_shares
from conftest import assert_same_on_all_ranks
from test_optimizer import FLOAT64_TRAINING
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import collectives as C
from collectives.integrations.ddp_hooks import allreduce_hook

pytestmark = pytest.mark.mpi

GLOBAL = 48  # samples of each global batch
SLOW = 3.0  # the last rank's seconds per sample over the others'
DELAY = 0.001  # the others' seconds per sample


def _data(samples: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(samples, 5, generator=g, dtype=torch.float64),
                                          torch.randn(samples, 2, generator=g, dtype=torch.float64))


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()


class _Clock:
    """The balancer's clock in these tests (its module's `time`): it moves only by the
    delays, so a rank measures exactly the speed its delay gives it, however loaded the
    machine (a real clock adds the compute and the machine's stalls, which once gave a
    3x slower rank shares [26, 22] instead of [36, 12])."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    monkeypatch.setattr(balance, "time", _Clock)


def _delay(comm, samples: int, slow: float) -> None:
    """This rank's extra compute: DELAY per sample, slow x that on the last rank."""
    last = comm.Get_rank() == comm.Get_size() - 1
    _Clock.now += samples * DELAY * (slow if last else 1.0)


def _train(comm, model, opt, balancer, sampler, slow: float, steps: int) -> list[list[int]]:
    """steps steps over the sampler's batches; each step's shares, every rank's indices
    checked to be exactly that step's global batch."""
    dataset, order = sampler.dataset, sampler._order()
    used = []
    for i, idx in enumerate(sampler):
        if i == steps:
            break
        x, y = (t.to(next(model.parameters()).dtype) for t in dataset[idx])
        with balancer.measure(len(idx)):
            _delay(comm, len(idx), slow)
            loss = nn.functional.mse_loss(model(x), y) * balancer.weight(len(idx))
            loss.backward()
        opt.step()
        opt.zero_grad()
        b = sampler.start + i
        assert sorted(sum(comm.allgather(idx), [])) == sorted(order[b * GLOBAL:(b + 1) * GLOBAL])
        used.append(list(balancer.shares))
        sampler.record_batch(i)
        balancer.step()
    return used


def _replay(dataset, sampler, steps: int,
            make=lambda m: torch.optim.SGD(m.parameters(), lr=0.1)) -> nn.Module:
    """One process, float64: make(model) stepping on the mean loss of each whole global
    batch."""
    model = _model()
    opt = make(model)
    order = sampler._order()
    for b in range(steps):
        x, y = dataset[order[b * GLOBAL:(b + 1) * GLOBAL]]
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def _flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def _expected(comm, slow: float) -> list[int]:
    """The shares at the speeds the delays make (compute itself left out)."""
    n = comm.Get_size()
    return proportional_shares(GLOBAL, [1.0] * (n - 1) + [1.0 / slow])


def _close(shares: list[int], expected: list[int], threshold: float) -> bool:
    return all(abs(s - e) <= threshold * e + 1 for s, e in zip(shares, expected, strict=True))


#: (the optimizer, the one-process optimizer its replay steps with, the model's dtype,
#: the bound on a parameter's difference from the replay)
OPTIMIZERS = {
    "distributed-sgd": (lambda m: DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                                       named_parameters=m.named_parameters()),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.1), torch.float64,
                        FLOAT64_TRAINING),
    "zero2-sgd": (lambda m: ZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), stage=2),
                  lambda m: torch.optim.SGD(m.parameters(), lr=0.1), torch.float64,
                  FLOAT64_TRAINING),
    # before freeze_step OnebitAdam is Adam on the averaged gradients; it trains float32:
    # roundings of 2**-24 over 24 steps stay far below 1e-4, a lost weighting gives ~1e-2
    "onebit-adam": (lambda m: OnebitAdam(m.parameters(), lr=0.01, freeze_step=1000),
                    lambda m: torch.optim.Adam(m.parameters(), lr=0.01), torch.float32, 1e-4),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_shares_follow_a_slowed_rank_and_training_equals_the_global_batch(comm, name):
    if comm.Get_size() < 2:
        pytest.skip("one rank has nothing to balance")
    dataset = _data(GLOBAL * 40)
    make, make_replay, dtype, bound = OPTIMIZERS[name]
    model = _model().to(dtype)
    broadcast_parameters(model.state_dict(), root_rank=0)
    opt = make(model)
    balancer = Balancer(GLOBAL, every=4, threshold=0.05)
    sampler = BalancedSampler(dataset, balancer, seed=1)
    used = _train(comm, model, opt, balancer, sampler, SLOW, steps=24)
    assert max(used[0]) - min(used[0]) <= 1  # equal at first
    assert used[-1][-1] < min(used[-1][:-1]), used  # the slowed rank got less
    assert _close(used[-1], _expected(comm, SLOW), 0.15), (used[-1], _expected(comm, SLOW))
    assert sum(used[-1]) == GLOBAL
    params = _flat(model)
    assert_same_on_all_ranks(comm, params, "balanced training")
    replay = _replay(dataset, sampler, 24, make_replay)
    assert np.abs(params - _flat(replay)).max() < bound


def test_equal_ranks_keep_equal_shares(comm):
    dataset = _data(GLOBAL * 20)
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
    balancer = Balancer(GLOBAL, every=3, threshold=0.1)
    sampler = BalancedSampler(dataset, balancer, seed=2)
    used = _train(comm, model, opt, balancer, sampler, 1.0, steps=15)
    even = used[0]
    assert max(even) - min(even) <= 1
    assert all(u == even for u in used), used


def test_ddp_with_a_timed_hook_balances_and_equals_the_global_batch(comm):
    if comm.Get_size() < 2:
        pytest.skip("one rank has nothing to balance")
    dist.init_process_group("collectives")
    try:
        dataset = _data(GLOBAL * 20)
        model = DDP(_model())
        balancer = Balancer(GLOBAL, every=4, threshold=0.05)
        model.register_comm_hook(None, balancer.timed(allreduce_hook))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = BalancedSampler(dataset, balancer, seed=3)
        used = _train(comm, model, opt, balancer, sampler, SLOW, steps=16)
        assert _close(used[-1], _expected(comm, SLOW), 0.15), (used[-1], _expected(comm, SLOW))
        params = _flat(model.module)
        assert_same_on_all_ranks(comm, params, "balanced DDP")
        assert np.abs(params - _flat(_replay(dataset, sampler, 16))).max() < FLOAT64_TRAINING
    finally:
        dist.destroy_process_group()


def test_a_restart_at_another_size_deals_the_rest_of_the_epoch(comm):
    """A sampler saved mid-epoch at the job's size, loaded on a set of one rank fewer (as
    after a shrink): equal shares over the set, and its ranks' batches are exactly the
    global batches not yet done."""
    n = comm.Get_size()
    if n < 2:
        pytest.skip("no smaller set to restart on")
    dataset = _data(GLOBAL * 6 + 5)
    balancer = Balancer(GLOBAL)
    balancer.shares = proportional_shares(GLOBAL, [1.0] * (n - 1) + [0.5])
    sampler = BalancedSampler(dataset, balancer, seed=4)
    for i, _ in enumerate(sampler):
        sampler.record_batch(i)
        if i == 1:
            break
    saved, order = sampler.state_dict(), sampler._order()
    member = comm.Get_rank() < n - 1
    survivors = C.add_process_set(list(range(n - 1)))
    sub = comm.Split(0 if member else 1)
    try:
        if member:
            small = Balancer(GLOBAL, process_set=survivors)
            small.load_state_dict(balancer.state_dict())  # another size: equal shares
            resumed = BalancedSampler(dataset, small, seed=4)
            resumed.load_state_dict(saved)
            assert small.shares == proportional_shares(GLOBAL, [1.0] * (n - 1))
            batches = list(resumed)
            assert len(batches) == len(resumed) == 4
            dealt = [sorted(sum(rows, [])) for rows in zip(*sub.allgather(batches), strict=True)]
            assert dealt == [sorted(order[b * GLOBAL:(b + 1) * GLOBAL]) for b in range(2, 6)]
    finally:
        sub.Free()
        C.remove_process_set(survivors)


def test_bad_arguments_raise(comm):
    with pytest.raises(ValueError, match="global_batch"):
        Balancer(comm.Get_size() - 1 if comm.Get_size() > 1 else 0)
    with pytest.raises(ValueError, match="every"):
        Balancer(GLOBAL, every=0)
    with pytest.raises(ValueError, match="threshold"):
        Balancer(GLOBAL, threshold=1.5)


def test_torch_state_commits_restores_and_syncs_the_sampler_and_its_shares(comm):
    from collectives.elastic import TorchState
    n = comm.Get_size()
    balancer = Balancer(GLOBAL)
    sampler = BalancedSampler(_data(GLOBAL * 8), balancer, seed=5)
    state = TorchState(sampler=sampler)
    skewed = proportional_shares(GLOBAL, [1.0 + r for r in range(n)])
    balancer.shares = list(skewed)
    for i, _ in enumerate(sampler):
        sampler.record_batch(i)
        if i == 2:
            break
    state.commit()
    for i, _ in enumerate(sampler):  # goes on from batch 3, then fails before a commit
        sampler.record_batch(i)
        if i == 1:
            break
    balancer.reset()
    assert sampler.done == 5 and balancer.shares != skewed or n == 1
    state.restore()
    assert (sampler.done, sampler.start, balancer.shares) == (3, 3, skewed)
    if comm.Get_rank() == 0:
        sampler.done, balancer.shares = 4, proportional_shares(GLOBAL, [1.0] * n)
    state.sync()  # everyone takes rank 0's
    assert (sampler.done, balancer.shares) == (4, proportional_shares(GLOBAL, [1.0] * n))
    assert len(list(sampler)) == len(sampler) == 4
