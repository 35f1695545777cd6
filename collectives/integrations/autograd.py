"""Differentiable collectives for torch autograd, on the public API.

allreduce_sum(x) is the Sum allreduce of x; its gradient is the Sum allreduce of the
incoming gradients (every rank's output depends on every rank's input with weight one).
SyncBatchNorm reduces its statistics through it so that backward covers the global batch."""

from __future__ import annotations

from typing import Any

import torch

from collectives import api
from collectives.ops import ReduceOp


class _AllreduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, process_set: Any) -> torch.Tensor:
        ctx.process_set = process_set
        return api.allreduce(tensor, ReduceOp.Sum, process_set=process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return allreduce_sum(grad, ctx.process_set), None


def allreduce_sum(tensor: torch.Tensor, process_set: Any = None) -> torch.Tensor:
    """The Sum of tensor over the ranks of process_set (None: the job), differentiable."""
    return _AllreduceSum.apply(tensor, process_set)
