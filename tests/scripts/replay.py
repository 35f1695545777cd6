"""The linear regression that the elastic test scripts train (survive.py, launched.py), and
its float64 single-process replay: SGD with momentum on the full batch, each step at the
learning rate of the world size it ran at, or Adam on a small network (whose steps do not
depend on it)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def data(step: int, batch: int, dim: int,
         dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Step's global batch: x drawn from the step's seed, y = x @ [1, ..., dim]."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch, dim, generator=g, dtype=torch.float64)
    return x.to(dtype), (x @ torch.arange(1.0, dim + 1, dtype=torch.float64)).to(dtype)


def _full_batch(model: torch.nn.Module, sizes: list[int], batch: int, dim: int,
                optimizer: torch.optim.Optimizer, lr_for: Callable[[int], float],
                after: Callable[[int], None] = lambda done: None) -> None:
    """One step of optimizer (over model's parameters) per entry of sizes, on the full
    batch, at lr_for(that size); after(steps done) after each."""
    for step, n in enumerate(sizes):
        x, y = data(step, batch, dim)
        for group in optimizer.param_groups:
            group["lr"] = lr_for(n)
        optimizer.zero_grad()
        # the mean of n per-rank losses, each scaled by n / batch, is the full-batch loss
        ((model(x).squeeze(1) - y) ** 2).sum().div(batch).backward()
        optimizer.step()
        after(step + 1)


def linear(dim: int) -> torch.nn.Module:
    """The linear model of the SGD runs: one float64 weight row, from zeros."""
    model = torch.nn.Linear(dim, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    return model


def mlp(dim: int) -> torch.nn.Module:
    """The network of the Adam runs: dim-64-64-1 with tanh, float64, drawn from seed 0 (the
    same on every rank and in the replay)."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.empty_like(p).uniform_(-1, 1, generator=g) / p.shape[-1] ** 0.5)
    return model


def replay(sizes: list[int], batch: int, dim: int,
           lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and momentum after one step per entry of sizes, from zeros, at lr times
    that size: what every rank of the elastic job must end with."""
    model = linear(dim)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    _full_batch(model, sizes, batch, dim, opt, lambda n: lr * n)
    return model.weight.detach(), opt.state[model.weight]["momentum_buffer"]


def adam_replay(steps: int, batch: int, dim: int, lr: float) -> list[torch.Tensor]:
    """The parameters of mlp(dim) after steps steps of Adam at lr on the full batch."""
    return adam_replays({steps}, batch, dim, lr)[steps][0]


def adam_replays(counts: set[int], batch: int, dim: int,
                 lr: float) -> dict[int, tuple[list[torch.Tensor], list[dict]]]:
    """For each number of steps in counts, the parameters of mlp(dim) after that many steps
    of Adam at lr on the full batch, and Adam's state of each (its step, exp_avg and
    exp_avg_sq): one replay for every count."""
    model = mlp(dim)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    found = {}

    def keep(done: int) -> None:
        if done in counts:
            found[done] = ([p.detach().clone() for p in model.parameters()],
                           [{k: v.clone() for k, v in opt.state[p].items()}
                            for p in model.parameters()])

    keep(0)
    _full_batch(model, [1] * max(counts), batch, dim, opt, lambda n: lr, keep)
    return found
