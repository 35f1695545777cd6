"""SyncBatchNorm: forward, backward and running statistics equal torch.nn.BatchNorm on the
global batch in one process, with a different number of samples on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import collectives.horovod as hvd


def _global_batch(n: int, shape: tuple, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((q + 2,) + shape, generator=g) * (q + 1) + q for q in range(n)]


@pytest.mark.parametrize("shape, reference", [((3,), nn.BatchNorm1d), ((3, 4), nn.BatchNorm1d),
                                              ((3, 2, 2), nn.BatchNorm2d)])
def test_matches_batch_norm_on_the_global_batch(comm, shape, reference):
    r, n = comm.Get_rank(), comm.Get_size()
    sync, ref = hvd.SyncBatchNorm(3, momentum=0.3), reference(3, momentum=0.3)
    with torch.no_grad():
        for m in (sync, ref):
            m.weight.copy_(torch.tensor([1.0, 2.0, -0.5]))
            m.bias.copy_(torch.tensor([0.1, 0.0, 0.3]))
    for step in range(2):
        parts = _global_batch(n, shape, seed=step)
        weights = _global_batch(n, shape, seed=100 + step)
        x = parts[r].clone().requires_grad_()
        y = sync(x)
        (y * weights[r]).sum().backward()
        whole = torch.cat(parts).requires_grad_()
        y_ref = ref(whole)
        (y_ref * torch.cat(weights)).sum().backward()
        start = sum(q + 2 for q in range(r))
        # float32: the statistics sum <= 56 elements a channel in another order than the
        # whole batch does (55 roundings of their size, values up to ~20, over a deviation
        # of ~3): ~170 roundings (1e-5) of an output's size; the gradients carry a second
        # such sum each, and the weights' gradient a sum over the batch (1e-4)
        torch.testing.assert_close(y, y_ref[start:start + r + 2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, whole.grad[start:start + r + 2], rtol=1e-4, atol=1e-5)
        for mine, theirs in ((sync.weight, ref.weight), (sync.bias, ref.bias)):
            total = hvd.allreduce(mine.grad, op=hvd.Sum)  # each rank holds its share
            torch.testing.assert_close(total, theirs.grad, rtol=1e-4, atol=1e-5)
            mine.grad = theirs.grad = None
        torch.testing.assert_close(sync.running_mean, ref.running_mean)
        torch.testing.assert_close(sync.running_var, ref.running_var)
    sync.eval()
    ref.eval()
    probe = torch.randn((2,) + shape)
    torch.testing.assert_close(sync(probe), ref(probe))


def test_bad_input(comm):
    with pytest.raises(ValueError, match="input: expected at least 2 dimensions"):
        hvd.SyncBatchNorm(3)(torch.ones(3))
    one = torch.ones(1 if comm.Get_rank() == 0 else 0, 3)  # one sample in the whole batch
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        hvd.SyncBatchNorm(3)(one)
