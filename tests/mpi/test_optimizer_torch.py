"""DistributedOptimizer is a torch.optim.Optimizer: LR schedulers, GradScaler, zero_grad,
state_dict and add_param_group work on it; Horovod's groups / num_groups /
sparse_as_dense; parameters that need no gradient, of any dtype; the warning after an
explicit synchronize()."""

from __future__ import annotations

import warnings

import pytest
import torch
from collectives.optim import DistributedOptimizer, broadcast_parameters
from conftest import assert_same_on_all_ranks
from test_optimizer import (
    FLOAT64_TRAINING,
    OPTIMIZERS,
    Net,
    batch,
    check_training,
    flat_params,
    max_diff,
    scaled_step,
    shard_loss,
)
from torch import nn


def _twins(comm, opt_name: str = "sgd", groups=None):
    """(model, its DistributedOptimizer, a copy, the copy's plain optimizer); groups: a
    function of the model giving DistributedOptimizer's groups."""
    torch.manual_seed(comm.Get_rank())
    model, ref = Net().double(), Net().double()
    broadcast_parameters(model.state_dict(), root_rank=0)
    ref.load_state_dict(model.state_dict())
    opt = DistributedOptimizer(OPTIMIZERS[opt_name](model.parameters()),
                               named_parameters=model.named_parameters(),
                               groups=groups(model) if groups else None)
    return model, opt, ref, OPTIMIZERS[opt_name](ref.parameters())


def _grads(comm, model, step: int) -> None:
    x, y = batch(comm.Get_size(), step, 0)
    shard_loss(model, x, y, comm.Get_rank()).backward()


def _ref_grads(n: int, ref, step: int) -> None:
    x, y = batch(n, step, 0)
    (sum(shard_loss(ref, x, y, s) for s in range(n)) / n).backward()


def test_is_an_optimizer_and_lr_schedulers_drive_it(comm):
    model, opt, ref, ref_opt = _twins(comm)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for step in range(5):
            _grads(comm, model, step)
            opt.step()
            opt.zero_grad(set_to_none=False)
            _ref_grads(comm.Get_size(), ref, step)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=False)
            sched.step()
            ref_sched.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.05 * 0.25
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert max_diff(model, ref) <= FLOAT64_TRAINING
    chained = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    chained.step()
    assert sched.get_last_lr() and chained.get_last_lr()


def test_grad_scaler_with_synchronize_then_skip(comm):
    """Horovod's pattern: reduce, unscale, then step without reducing again."""
    model, opt, ref, ref_opt = _twins(comm)
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=64.0), \
        torch.amp.GradScaler("cpu", init_scale=64.0)
    for step in range(3):
        scaled_step(comm, model, opt, ref, ref_opt, (scaler, ref_scaler), step)
    assert max_diff(model, ref) <= FLOAT64_TRAINING
    assert_same_on_all_ranks(comm, flat_params(model).numpy(), "parameters")


def test_step_after_an_explicit_synchronize_warns(comm):
    model, opt, *_ = _twins(comm)
    _grads(comm, model, 0)
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()
    opt.zero_grad()
    _grads(comm, model, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # no explicit synchronize: no warning


class WithBuffers(nn.Module):
    """A model whose optimizer also holds parameters that need no gradient, of an integer
    dtype (a step counter) and a frozen float one."""

    def __init__(self):
        super().__init__()
        self.body = Net()
        self.count = nn.Parameter(torch.zeros(3, dtype=torch.int32), requires_grad=False)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x, shard):
        return self.body(x, shard)


def test_parameters_without_gradients_of_any_dtype_are_allowed(comm):
    torch.manual_seed(0)
    model = WithBuffers().double()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
    x, y = batch(comm.Get_size(), 0, 0)
    shard_loss(model, x, y, comm.Get_rank()).backward()
    opt.step()
    assert model.count.dtype == torch.int32 and not model.count.any()
    assert_same_on_all_ranks(comm, flat_params(model.body).numpy(), "parameters")


@pytest.mark.parametrize("num_groups", [2, 50])
def test_num_groups(comm, num_groups):
    check_training(comm, Net, "adam", steps=3, num_groups=num_groups)


def test_groups_are_reduced_together(comm):
    def pick(model):
        return [[model.body[0].weight, model.extra.bias], [model.body[2].weight]]

    model, opt, ref, ref_opt = _twins(comm, groups=pick)
    groups = pick(model)
    grouped = [{id(p) for p in b.params} for b in opt._buckets]
    assert {id(p) for p in groups[0]} in grouped and {id(p) for p in groups[1]} in grouped
    for step in range(3):
        _grads(comm, model, step)
        opt.step()
        opt.zero_grad()
        _ref_grads(comm.Get_size(), ref, step)
        ref_opt.step()
        ref_opt.zero_grad()
    assert max_diff(model, ref) <= FLOAT64_TRAINING


@pytest.mark.parametrize("sparse_as_dense", [True, False])
def test_sparse_gradients(comm, sparse_as_dense):
    """nn.Embedding(sparse=True) trains: dense (sparse_as_dense) or through the allgather
    of every rank's indices and values (the gradient stays sparse)."""
    r, n = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True).double()
    ref = nn.Embedding(10, 3, sparse=True).double()
    ref.load_state_dict(emb.state_dict())
    opt = DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                               named_parameters=emb.named_parameters(),
                               sparse_as_dense=sparse_as_dense)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        ids = [torch.tensor([(q + step) % 10, (2 * q + 1) % 10, (q + step) % 10])
               for q in range(n)]
        emb(ids[r]).square().sum().backward()
        opt.synchronize()
        assert emb.weight.grad.is_sparse  # reduced dense or gathered, handed back sparse
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
        (sum(ref(i).square().sum() for i in ids) / n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert torch.allclose(emb.weight, ref.weight, rtol=0, atol=FLOAT64_TRAINING)


def test_bad_horovod_arguments():
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="groups, num_groups"):
        DistributedOptimizer(sgd, num_groups=2, groups=[[model.extra.bias]])
    with pytest.raises(ValueError, match=r"groups\[0\]"):
        DistributedOptimizer(sgd, groups=[[torch.zeros(2)]])
    with pytest.raises(ValueError, match="num_groups"):
        DistributedOptimizer(sgd, num_groups=-1)
    with pytest.raises(TypeError, match="already a DistributedOptimizer"):
        DistributedOptimizer(DistributedOptimizer(sgd))
