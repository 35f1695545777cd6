"""DistributedOptimizer and the broadcasts with Horovod's signatures and averaging."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from collectives.api.process_sets import (
    ProcessSet,
    global_process_set,
)
from collectives.compression import Compression
from collectives.horovod.common import Adasum, Average, set_of
from collectives.optim import adasum as _optim_adasum
from collectives.optim import broadcast as _broadcast
from collectives.optim import distributed as _optim


def broadcast_parameters(params, root_rank, process_set=global_process_set) -> None:
    _broadcast.broadcast_parameters(params, root_rank, process_set=set_of(process_set))


def broadcast_optimizer_state(optimizer, root_rank, model=None,
                              process_set=global_process_set) -> None:
    """root_rank's optimizer state and hyper-parameters on every rank. model: Horovod's,
    not needed here (state an optimizer creates lazily arrives by load_state_dict). As
    Horovod's (which takes a zero-gradient step), it leaves every trainable parameter
    without a gradient with a zero one."""
    _broadcast.broadcast_optimizer_state(optimizer, root_rank, process_set=set_of(process_set))
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 (Horovod's name)
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set):
    """optim.DistributedOptimizer with Horovod's signature (a torch.optim.Optimizer) and
    Horovod's averaging: under join(), over every rank of the set, joined ones adding
    zeros."""
    if op == Adasum:
        return _optim_adasum.DistributedAdasumOptimizer(
            optimizer, named_parameters=named_parameters,
            backward_passes_per_step=backward_passes_per_step, process_set=set_of(process_set))
    return _optim.DistributedOptimizer(
        optimizer, named_parameters=named_parameters, compression=compression,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
        groups=groups, sparse_as_dense=sparse_as_dense, process_set=set_of(process_set),
        divide_by_initial_world_size=True)

