"""SyncBatchNorm (Horovod's): batch normalization whose statistics cover the global batch,
every rank's samples, however many each holds.

In training, each rank sums its samples' values and squares per channel; one allreduce of
[count, sums, sums of squares] (float64) gives the global mean and biased variance, which
normalize the local samples and update the running statistics (unbiased variance) exactly
as torch.nn.BatchNorm on the whole batch would. The allreduce is differentiable
(integrations/autograd.py: its gradient is the Sum allreduce of the incoming
gradients), so autograd's backward through it is the global batch's: each rank's input
gradient is its rows of the single-process gradient, and weight and bias get this rank's
share (summed over ranks by DistributedOptimizer's reduction, as in torch and Horovod).
Cost: one allreduce of 2C+1 values per forward and one per backward. In eval mode, or
without running statistics in eval, it is plain batch norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from collectives.integrations.autograd import allreduce_sum


class SyncBatchNorm(_BatchNorm):
    """torch.nn.BatchNorm{1,2,3}d over the global batch (input (N, C, ...))."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_set=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"input: expected at least 2 dimensions (N, C, ...), got {x.dim()}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training and self.track_running_stats:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        dims = [0] + list(range(2, x.dim()))
        x64 = x.to(torch.float64)
        local = torch.cat([torch.tensor([x.numel() / x.shape[1]], dtype=torch.float64),
                           x64.sum(dims), (x64 * x64).sum(dims)])
        total = allreduce_sum(local, self.process_set)
        count, channels = total[0], x.shape[1]
        if count.item() <= 1:  # as BatchNorm: every rank sees the same global count
            raise ValueError(f"input: expected more than 1 value per channel when training, "
                             f"got {int(count.item())} over all ranks")
        mean = total[1:1 + channels] / count
        var = total[1 + channels:] / count - mean * mean  # biased, as normalization uses
        if self.training and self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), count.item())
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x64 - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        y = y.to(x.dtype)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        self.num_batches_tracked.add_(1)
        factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                  else self.momentum)
        unbiased = var * (count / max(count - 1.0, 1.0))
        with torch.no_grad():
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype),
                                                   alpha=factor)
