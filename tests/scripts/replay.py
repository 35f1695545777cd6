"""The linear regression that the elastic test scripts train (survive.py, launched.py), and
its float64 single-process replay: SGD with momentum on the full batch, each step at the
learning rate of the world size it ran at, or Adam (whose steps do not depend on it)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def data(step: int, batch: int, dim: int,
         dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Step's global batch: x drawn from the step's seed, y = x @ [1, ..., dim]."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch, dim, generator=g, dtype=torch.float64)
    return x.to(dtype), (x @ torch.arange(1.0, dim + 1, dtype=torch.float64)).to(dtype)


def _full_batch(sizes: list[int], batch: int, dim: int,
                optimizer: torch.optim.Optimizer, lr_for: Callable[[int], float]) -> None:
    """One step of optimizer (over its one weight) per entry of sizes, on the full
    batch, at lr_for(that size)."""
    ref = optimizer.param_groups[0]["params"][0]
    for step, n in enumerate(sizes):
        x, y = data(step, batch, dim)
        optimizer.param_groups[0]["lr"] = lr_for(n)
        optimizer.zero_grad()
        # the mean of n per-rank losses, each scaled by n / batch, is the full-batch loss
        (((x @ ref.t()).squeeze(1) - y) ** 2).sum().div(batch).backward()
        optimizer.step()


def _zeros(dim: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(1, dim, dtype=torch.float64))


def replay(sizes: list[int], batch: int, dim: int,
           lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and momentum after one step per entry of sizes, from zeros, at lr times
    that size: what every rank of the elastic job must end with."""
    weight = _zeros(dim)
    opt = torch.optim.SGD([weight], lr=lr, momentum=0.9)
    _full_batch(sizes, batch, dim, opt, lambda n: lr * n)
    return weight.detach(), opt.state[weight]["momentum_buffer"]


def adam_replay(steps: int, batch: int, dim: int, lr: float) -> torch.Tensor:
    """The weight after steps steps of Adam at lr on the full batch, from zeros."""
    weight = _zeros(dim)
    _full_batch([1] * steps, batch, dim, torch.optim.Adam([weight], lr=lr), lambda n: lr)
    return weight.detach()
