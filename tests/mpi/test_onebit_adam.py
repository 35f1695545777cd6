"""OnebitAdam (optim/onebit_adam.py): Adam(W) before the freeze, bitwise resume from a
checkpoint, bytes per step after the freeze, and convergence against Adam on real data
(benchmarks/convergence.py's tasks; benchmarks/onebit_convergence.py runs the fuller sweep)."""

from __future__ import annotations

import copy
import importlib.util
import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from collectives.optim import DistributedOptimizer
from collectives.optim.onebit_adam import OnebitAdam
from torch import nn

import collectives as C

pytestmark = pytest.mark.mpi


def _convergence():
    """benchmarks/convergence.py of this checkout (no part of the installed library), loaded
    by its path: benchmarks/ on sys.path would let its scripts shadow other modules."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "convergence.py"
    spec = importlib.util.spec_from_file_location("benchmarks_convergence", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # for dataclasses
    spec.loader.exec_module(module)
    return module


mlp, my_slice, ring_bytes, train = (getattr(_convergence(), f)
                                    for f in ("mlp", "my_slice", "ring_bytes", "train"))


def _adam(params: list, lr: float, freeze_step: int) -> DistributedOptimizer:
    return DistributedOptimizer(torch.optim.Adam(params, lr=lr), algorithm="ring")


def _onebit(params: list, lr: float, freeze_step: int) -> OnebitAdam:
    return OnebitAdam(params, lr=lr, freeze_step=freeze_step)  # its defaults otherwise


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _train(model: nn.Module, opt, steps: range) -> None:
    """Steps on deterministic global batches of 12 rows, each rank taking its slice."""
    for step in steps:
        rng = np.random.default_rng(step)
        x = torch.tensor(rng.standard_normal((12, 8)), dtype=torch.float32)
        y = torch.tensor(rng.integers(0, 3, 12))
        mine = my_slice(12)
        loss = F.cross_entropy(model(x[mine]), y[mine], reduction="sum") * C.size() / 12
        loss.backward()
        opt.step()
        opt.zero_grad()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_before_the_freeze_it_is_adamw():
    ours, theirs = _model(0), _model(0)
    opt = OnebitAdam(ours.parameters(), lr=1e-2, weight_decay=0.1, freeze_step=1000)
    ref = DistributedOptimizer(torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1))
    _train(ours, opt, range(10))
    _train(theirs, ref, range(10))
    for a, b in zip(_params(ours), _params(theirs)):
        assert torch.equal(a, b)


@pytest.mark.mpi(min_size=2)
def test_resume_continues_bitwise():
    """Stopped after the freeze (error buffers in use) and resumed from each rank's own
    state dict, training continues exactly as if it had never stopped."""
    model = _model(0)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=5, block_size=16)
    _train(model, opt, range(12))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, saved)
    _train(model, opt, range(12, 20))
    expected = _params(model)

    resumed = _model(1)
    opt2 = OnebitAdam(resumed.parameters(), lr=1e-2, freeze_step=5, block_size=16)
    saved.seek(0)
    checkpoint = torch.load(saved)
    resumed.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optimizer"])
    state = opt2.state[resumed[0].weight]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "worker_error", "server_error"}
    assert state["step"] == 12 and state["worker_error"].abs().sum() > 0
    _train(resumed, opt2, range(12, 20))
    for a, b in zip(_params(resumed), expected):
        assert torch.equal(a, b)


@pytest.mark.mpi(min_size=2)
def test_another_ranks_error_buffers_are_reset():
    """Loading rank 0's state (as broadcast_optimizer_state does) keeps the moments and
    the step everywhere, but error buffers only where they belong."""
    model = _model(0)
    opt = OnebitAdam(model.parameters(), freeze_step=2)
    _train(model, opt, range(4))
    state = C.broadcast_object(copy.deepcopy(opt.state_dict()), root_rank=0)
    opt.load_state_dict(state)
    loaded = opt.state[model[0].weight]
    assert loaded["step"] == 4
    assert ("worker_error" in loaded) == (C.rank() == 0)
    _train(model, opt, range(4, 6))  # zeros again, then in use
    assert "worker_error" in opt.state[model[0].weight]


@pytest.mark.mpi(min_size=2)
def test_bytes_per_step_after_the_freeze():
    """One compressed step of the digits MLP sends under 1/20 of a float32 ring allreduce."""
    torch.manual_seed(0)
    model = mlp(64, 10)
    opt = OnebitAdam(model.parameters(), freeze_step=1)
    sent = []
    for _ in range(2):  # the second step is compressed
        before = C.stats()["bytes_sent"]
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sent.append(C.stats()["bytes_sent"] - before)
    sent = sent[-1]
    ring = ring_bytes(sum(p.numel() for p in model.parameters()))
    assert 0 < sent <= ring / 20, f"{sent} bytes per step, a float32 ring sends {ring:.0f}"


@pytest.mark.parametrize("task,runs", [
    ("digits", [(0, 1e-3), (1, 2e-3), (2, 3e-3)]),
    ("cancer", [(0, 1e-3), (1, 3e-3)]),
])
def test_converges_like_adam(task, runs):
    """Within 2 points of Adam's test accuracy on the same global batches (the digits'
    blank pixels are what make DeepSpeed's version diverge); replicas bit-identical."""
    for seed, lr in runs:
        adam = train(task, _adam, seed, lr, epochs=10)
        ours = train(task, _onebit, seed, lr, epochs=10)
        assert ours.finite and ours.accuracy >= adam.accuracy - 2, (seed, lr, adam, ours)
        digests = C.allgather(np.array([[int(ours.digest[:15], 16)]]))
        assert (digests == digests[0]).all()


def test_rejects_bad_arguments():
    params = list(_model(0).parameters())
    for kwargs, name in [({"lr": -1.0}, "lr"), ({"betas": (0.9,)}, "betas"),
                         ({"betas": (0.9, 1.0)}, r"betas\[1\]"), ({"eps": -1}, "eps"),
                         ({"weight_decay": "x"}, "weight_decay"), ({"freeze_step": 0}, "freeze_step"),
                         ({"block_size": 0}, "block_size"), ({"max_update": 0.0}, "max_update")]:
        with pytest.raises(ValueError, match=name):
            OnebitAdam(params, **kwargs)
    with pytest.raises(TypeError, match="params: OnebitAdam needs float32"):
        OnebitAdam([torch.zeros(3, dtype=torch.float64, requires_grad=True)])
