"""The linear regression that the elastic test scripts train (survive.py, launched.py), and
its float64 single-process replay: SGD with momentum on the full batch, each step at the
learning rate of the world size it ran at, or Adam (whose steps do not depend on it)."""

from __future__ import annotations

import torch


def data(step: int, batch: int, dim: int,
         dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Step's global batch: x drawn from the step's seed, y = x @ [1, ..., dim]."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch, dim, generator=g, dtype=torch.float64)
    return x.to(dtype), (x @ torch.arange(1.0, dim + 1, dtype=torch.float64)).to(dtype)


def replay(sizes: list[int], batch: int, dim: int,
           lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and momentum after one step per entry of sizes, from zeros, at lr times
    that size: what every rank of the elastic job must end with."""
    ref = torch.nn.Linear(dim, 1, bias=False).double()
    torch.nn.init.zeros_(ref.weight)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    for step, n in enumerate(sizes):
        x, y = data(step, batch, dim)
        opt.param_groups[0]["lr"] = lr * n
        opt.zero_grad()
        # the mean of n per-rank losses, each scaled by n / batch, is the full-batch loss
        (((ref(x).squeeze(1) - y) ** 2).sum() / batch).backward()
        opt.step()
    return ref.weight.detach(), opt.state[ref.weight]["momentum_buffer"]


def adam_replay(steps: int, batch: int, dim: int, lr: float) -> torch.Tensor:
    """The weight after steps steps of Adam at lr on the full batch, from zeros."""
    ref = torch.nn.Linear(dim, 1, bias=False).double()
    torch.nn.init.zeros_(ref.weight)
    opt = torch.optim.Adam(ref.parameters(), lr=lr)
    for step in range(steps):
        x, y = data(step, batch, dim)
        opt.zero_grad()
        (((ref(x).squeeze(1) - y) ** 2).sum() / batch).backward()
        opt.step()
    return ref.weight.detach()
