"""The linear regression that the elastic test scripts train (survive.py, launched.py), and
its float64 single-process replay: SGD with momentum on the full batch, each step at the
learning rate of the world size it ran at, or Adam on a small network (whose steps do not
depend on it)."""

from __future__ import annotations

import copy
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


def batches_replay(x: torch.Tensor, y: torch.Tensor, batches: list[list[int]],
                   lr: float) -> torch.Tensor:
    """The weight of linear(x's width) after one step of SGD (lr, momentum 0.9) on the mean
    squared error of each batch of rows of (x, y) in turn: what a job whose ranks split
    those global batches (in any shares, each loss weighted by its share) must end with."""
    model = linear(x.shape[1])
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for rows in batches:
        opt.zero_grad()
        ((model(x[rows]).squeeze(1) - y[rows]) ** 2).mean().backward()
        opt.step()
    return model.weight.detach()


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


def diloco_replay(sizes: list[int], batch: int, dim: int, lr: float, sync_every: int,
                  fragments: list[list[int]]) -> tuple[list[list[torch.Tensor]],
                                                        list[torch.Tensor]]:
    """DiLoCo over mlp(dim), simulated in float64 with one model and one Adam (lr) per rank,
    rank r of n training on its r-th n-th of each global batch: every sync_every /
    len(fragments) steps the next fragment's average change (anchor - params) is sent and
    the one sent before is applied (overlapped, one fragment late) by Nesterov SGD (lr 0.7,
    momentum 0.9) to the anchor, each rank's fragment becoming the new anchor plus its
    change since it sent. Where sizes changes, every rank starts again as a copy of rank 0
    (an elastic job's restore and sync). Returns each rank's parameters and the anchor."""
    base = mlp(dim)
    anchor = [p.detach().clone() for p in base.parameters()]
    outer_momentum: list[torch.Tensor | None] = [None] * len(anchor)
    models: list[torch.nn.Module] = []
    adams: list[torch.optim.Optimizer] = []
    pending = None  # (fragment, average, what each rank had when it sent)
    interval = sync_every // len(fragments)

    def flat(params: list[torch.Tensor], fragment: list[int]) -> torch.Tensor:
        return torch.cat([params[i].detach().reshape(-1) for i in fragment])

    def apply(fragment: int, average: torch.Tensor, sent: list[torch.Tensor]) -> None:
        offset = 0
        for i in fragments[fragment]:
            n = anchor[i].numel()
            g = average[offset:offset + n].view_as(anchor[i])
            buf = g.clone() if outer_momentum[i] is None else outer_momentum[i] * 0.9 + g
            outer_momentum[i] = buf
            anchor[i] = anchor[i] - 0.7 * (g + 0.9 * buf)
            for model, had in zip(models, sent, strict=True):
                p = list(model.parameters())[i]
                with torch.no_grad():
                    p.copy_(anchor[i] + p - had[offset:offset + n].view_as(p))
            offset += n

    for step, n in enumerate(sizes):
        if step == 0 or n != sizes[step - 1]:  # every rank a copy of rank 0
            first = models[0] if models else base
            first_adam = adams[0].state_dict() if adams else None
            models = [mlp(dim) for _ in range(n)]
            adams = [torch.optim.Adam(m.parameters(), lr=lr) for m in models]
            for m, a in zip(models, adams, strict=True):
                m.load_state_dict(first.state_dict())
                if first_adam is not None:  # a copy: load_state_dict keeps its tensors
                    a.load_state_dict(copy.deepcopy(first_adam))
            if pending is not None:
                pending = (pending[0], pending[1], [pending[2][0]] * n)
        x, y = data(step, batch, dim)
        for r, (model, adam) in enumerate(zip(models, adams, strict=True)):
            lo, hi = r * batch // n, (r + 1) * batch // n
            adam.zero_grad()
            ((model(x[lo:hi]).squeeze(1) - y[lo:hi]) ** 2).sum().mul(n / batch).backward()
            adam.step()
        if (step + 1) % interval == 0:
            if pending is not None:
                apply(*pending)
            fragment = ((step + 1) // interval - 1) % len(fragments)
            now = [flat(list(m.parameters()), fragments[fragment]) for m in models]
            average = sum(flat(anchor, fragments[fragment]) - had for had in now) / n
            pending = (fragment, average, now)
    if pending is not None:
        apply(*pending)
    return [[p.detach() for p in m.parameters()] for m in models], anchor
