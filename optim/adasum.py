"""Data-parallel training with Adasum (Horovod's op=Adasum optimizer): each rank steps its
optimizer on its own gradients, then the parameter deltas of that step are combined across
ranks with Adasum (collectives/api/adasum.py) and every rank applies the combined delta to the
parameters it started the step from. Combining the updates, not the gradients, is what lets
Adasum scale the learning rate of optimizers like Adam as well as SGD.

Costs one Adasum allreduce per parameter tensor per step (log2(n) whole-tensor exchanges
each); the number of ranks must be a power of two."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from collectives.api import adasum

from .wrapped import WrappedOptimizer, _check_int, _user_names


class DistributedAdasumOptimizer(WrappedOptimizer):
    """Wraps a torch optimizer; step() = local step, then Adasum of the parameter deltas.
    Every rank must wrap the same parameters; those with requires_grad=False are left
    alone."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 backward_passes_per_step: int = 1, process_set: Any = None):
        super().__init__(optimizer)
        # Nothing is reduced before step(), so gradients of any number of backward passes
        # accumulate locally anyway: the argument is checked, as Horovod's, and not needed.
        _check_int("backward_passes_per_step", backward_passes_per_step, 1)
        self._names = None if named_parameters is None else _user_names(named_parameters)
        self._process_set = process_set

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        starts = [p.detach().clone() for p in params]
        loss = self.optimizer.step(closure)
        with torch.no_grad():
            for i, (p, start) in enumerate(zip(params, starts)):
                name = None if self._names is None else self._names.get(id(p))
                delta = adasum.allreduce(p.detach() - start, process_set=self._process_set,
                                         name=name or f"adasum.{i}")
                p.copy_(start + delta)
        return loss

    def synchronize(self) -> None:
        """Nothing to wait for: the combination happens inside step()."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield
