"""Each bucket's reduction runs while backward goes on, compressed or not: in
DistributedOptimizer, ZeroOptimizer, OnebitAdam (its warm-up and after) and the DDP hooks on
the "collectives" backend.

The model is two layers in two buckets, with a pause in backward between them (the layer
nearer the input gets its gradients after it). The bucket of the layer nearer the output
is complete before the pause, and the pause lasts until this rank has finished a call
since backward began (at most PAUSE_BOUND_S): a reduction launched during backward ends
it in milliseconds, one started only at the end of backward (or in step()) cannot, and
the pause ends at its bound with no call finished."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from collectives.optim import DistributedOptimizer, OnebitAdam, ZeroOptimizer, onebit_adam
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import collectives as C
from collectives.integrations.ddp_hooks import OnebitHookState, fp16_hook, int8_hook, onebit_hook

pytestmark = pytest.mark.mpi(min_size=2)

WIDTH = 1024  # a layer's weight: 4 MiB, over DDP's first bucket (1 MiB)
BUCKET_BYTES = 4 * (WIDTH * WIDTH + WIDTH)  # one layer's weight and bias: a bucket each
PAUSE_BOUND_S = 30.0  # a hang's bound: the pause ends at the first finished call


class _Pause(torch.autograd.Function):
    """The identity; when `after` is set (the calls finished before backward), its
    backward waits until this rank has finished more collective calls than that
    (C.stats()["calls"], at most PAUSE_BOUND_S), then notes the count in `seen`."""

    seen: list[int] = []
    after: int | None = None

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if _Pause.after is not None:
            deadline = time.monotonic() + PAUSE_BOUND_S
            while C.stats()["calls"] <= _Pause.after and time.monotonic() < deadline:
                time.sleep(1e-3)
        _Pause.seen.append(C.stats()["calls"])
        return grad


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(_Pause.apply(self.first(x)))


def _reduced_during_backward(model: nn.Module, opt, steps: int = 3,
                             unchecked: int = 0) -> list[int]:
    """Per step after the first `unchecked` (which do not pause), the calls finished
    between backward's start and the pause's end."""
    out = []
    for step in range(steps):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step + C.rank()))
        _Pause.seen.clear()
        before = C.stats()["calls"]
        _Pause.after = before if step >= unchecked else None
        try:
            model(x).square().mean().backward()
        finally:
            _Pause.after = None
        if step >= unchecked:
            out.append(_Pause.seen[0] - before)
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("compression", ["none", "fp16", "int8", "int4"])
def test_distributed_optimizer_reduces_during_backward(comm, compression):
    model = _Model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(),
                               compression=getattr(C.Compression, compression),
                               fusion_threshold_bytes=BUCKET_BYTES)
    assert all(n >= 1 for n in _reduced_during_backward(model, opt)), compression


@pytest.mark.parametrize("compression", ["none", "int8", "onebit"])
def test_zero_optimizer_reduces_during_backward(comm, compression):
    model = _Model()
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), stage=2,
                        compression=getattr(C.Compression, compression, compression),
                        fusion_threshold_bytes=BUCKET_BYTES)
    assert all(n >= 1 for n in _reduced_during_backward(model, opt)), compression


def test_onebit_adam_averages_during_backward(comm, monkeypatch):
    """In the warm-up (steps 1-2) each bucket of gradients, after the freeze each
    bucket's 1-bit momenta, starts its average from the gradient hooks."""
    monkeypatch.setattr(onebit_adam, "BUCKET_BYTES", BUCKET_BYTES)  # a layer a bucket
    model = _Model()
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2)
    assert all(n >= 1 for n in _reduced_during_backward(model, opt, steps=4))


def test_onebit_adam_counts_backward_passes(comm):
    """With backward_passes_per_step=2 two backward passes make a step, the same on every
    rank; a third pass before step() is an error that names the option."""
    model = _Model()
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=1, backward_passes_per_step=2)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(C.rank()))
    for _ in range(3):
        for _ in range(2):
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for p in model.parameters():
        assert torch.equal(p, C.broadcast(p.detach(), root_rank=0))
    for _ in range(2):
        model(x).square().mean().backward()
    with pytest.raises(RuntimeError, match="backward_passes_per_step=2"):
        model(x).square().mean().backward()
    opt.step()  # what the two passes launched finishes


@pytest.mark.parametrize("hook", ["fp16", "int8", "onebit"])
def test_ddp_hooks_reduce_during_backward(comm, hook):
    dist.init_process_group("collectives")
    try:
        model = DDP(_Model(), bucket_cap_mb=1)
        if hook == "onebit":  # compressed from the first step
            model.register_comm_hook(OnebitHookState(warmup_steps=0), onebit_hook)
        else:
            model.register_comm_hook(None, fp16_hook if hook == "fp16" else int8_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        # DDP's first step fills its buckets in the order gradients arrive; later ones
        # follow it
        assert all(n >= 1 for n in _reduced_during_backward(model, opt, steps=4,
                                                            unchecked=1)), hook
    finally:
        dist.destroy_process_group()
