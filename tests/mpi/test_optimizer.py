"""DistributedOptimizer and the broadcasts: data-parallel training equals single-process
training on the global batch, step for step, at whatever world size the file runs at.

Every rank starts from a different random init and adopts rank 0's model and optimizer
(hyper-parameters included: each rank's lr differs) through broadcast_parameters and
broadcast_optimizer_state. The reference trains, on every rank, a copy of rank 0's model on
the whole global batch in one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from collectives.optim import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from conftest import assert_same_on_all_ranks
from torch import nn

import collectives as C

pytestmark = pytest.mark.mpi

IN, OUT, PER_RANK = 6, 4, 3  # features, outputs, samples per rank per backward pass
OPTIMIZERS = {
    "sgd": lambda params, scale=1.0: torch.optim.SGD(params, lr=0.05 * scale, momentum=0.9),
    "adam": lambda params, scale=1.0: torch.optim.Adam(params, lr=0.01 * scale),
}


#: float64 training against one process on the global batch: the gradients' sums run in
#: another order, a few roundings of 2**-53 each, carried over a few steps into parameters
#: of size ~1: differences of ~1e-15 on any SIMD path. 1e-9 is far above that and far below
#: an error of the algorithm (a rank's gradient lost or counted twice: >= 1e-3).
FLOAT64_TRAINING = 1e-9
class Net(nn.Module):
    """A small MLP; with unused=True its `extra` head is used only by shard 0 and its
    `dead` layer never (their gradients are missing on some or all ranks)."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.unused = unused
        self.body = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))
        self.extra = nn.Linear(IN, OUT)
        if unused:
            self.dead = nn.Linear(OUT, OUT)

    def forward(self, x: torch.Tensor, shard: int) -> torch.Tensor:
        out = self.body(x)
        return out + self.extra(x) if shard == 0 or not self.unused else out


class Branches(nn.Module):
    """Independent layers run in a caller-chosen order: backward produces their gradients
    in the reverse of that order."""

    def __init__(self, count: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(IN, IN) for _ in range(count))

    def forward(self, x: torch.Tensor, shard: int) -> torch.Tensor:
        order = list(range(len(self.layers)))
        order = order[shard:] + order[:shard] if shard % 2 == 0 else order[::-1]
        return sum(self.layers[i](x).tanh() for i in order)


def batch(n: int, step: int, micro: int, dtype=torch.float64) -> tuple[torch.Tensor, ...]:
    """The global batch of (step, micro): the same on every rank (targets for IN outputs;
    a model with fewer uses the first columns)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(n * PER_RANK, IN, generator=g, dtype=dtype)
    return x, torch.randn(n * PER_RANK, IN, generator=g, dtype=dtype)


def shard_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, shard: int) -> torch.Tensor:
    rows = slice(shard * PER_RANK, (shard + 1) * PER_RANK)
    out = model(x[rows], shard)
    return F.mse_loss(out, y[rows, :out.shape[1]])


def setup(comm, model_fn, opt_name: str, dtype=torch.float64, **kwargs):
    """(model, DistributedOptimizer, reference model, reference optimizer): each rank starts
    from its own init and lr, then adopts rank 0's by broadcast."""
    rank = comm.Get_rank()
    torch.manual_seed(rank)
    model = model_fn().to(dtype)
    opt = DistributedOptimizer(OPTIMIZERS[opt_name](model.parameters(), 1.0 + rank),
                               named_parameters=model.named_parameters(), **kwargs)
    broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast_optimizer_state(opt, root_rank=0)
    ref = model_fn().to(dtype)
    ref.load_state_dict(model.state_dict())
    return model, opt, ref, OPTIMIZERS[opt_name](ref.parameters())


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return (flat_params(a) - flat_params(b)).abs().max().item()


def distributed_step(comm, model, opt, step: int, passes: int = 1, clip: float | None = None,
                     dtype=torch.float64) -> None:
    """One optimizer step of `passes` backward passes on this rank's shards."""
    for micro in range(passes):
        x, y = batch(comm.Get_size(), step, micro, dtype)
        shard_loss(model, x, y, comm.Get_rank()).backward()
    if clip is None:
        opt.step()
    else:
        opt.synchronize()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        with opt.skip_synchronize():
            opt.step()
    opt.zero_grad()


def scaled_step(comm, model, opt, ref, ref_opt, scalers, step: int,
                dtype=torch.float64) -> None:
    """One GradScaler step in Horovod's pattern on opt (reduce with synchronize(), unscale,
    step inside skip_synchronize()) and a plain one on ref_opt over every shard; scalers:
    (opt's, ref_opt's)."""
    scaler, ref_scaler = scalers
    n = comm.Get_size()
    x, y = batch(n, step, 0, dtype)
    scaler.scale(shard_loss(model, x, y, comm.Get_rank())).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    ref_scaler.scale(sum(shard_loss(ref, x, y, s) for s in range(n)) / n).backward()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    ref_opt.zero_grad()


def reference_step(n: int, ref, ref_opt, step: int, passes: int = 1, clip: float | None = None,
                   grad_scale: float = 1.0, dtype=torch.float64) -> None:
    """The same step in one process: the loss averaged over all n shards."""
    for micro in range(passes):
        x, y = batch(n, step, micro, dtype)
        (sum(shard_loss(ref, x, y, s) for s in range(n)) * grad_scale / n).backward()
    if clip is not None:
        nn.utils.clip_grad_norm_(ref.parameters(), clip)
    ref_opt.step()
    ref_opt.zero_grad()


def check_training(comm, model_fn, opt_name: str, steps: int = 10, passes: int = 1,
                   tol: float = 1e-4, clip: float | None = None, grad_scale: float = 1.0,
                   dtype=torch.float64, **kwargs) -> None:
    model, opt, ref, ref_opt = setup(comm, model_fn, opt_name, dtype,
                                     backward_passes_per_step=passes, **kwargs)
    for step in range(steps):
        distributed_step(comm, model, opt, step, passes, clip, dtype)
        reference_step(comm.Get_size(), ref, ref_opt, step, passes, clip, grad_scale, dtype)
        diff = max_diff(model, ref)
        assert diff <= tol, f"step {step}: max parameter difference {diff:.3g} > {tol}"
    assert_same_on_all_ranks(comm, flat_params(model).numpy(), "parameters")


@pytest.mark.parametrize("unused", [False, True])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_matches_single_process(comm, opt_name, passes, unused):
    # 256 bytes: several buckets, the first holding the parameters some ranks leave unused
    check_training(comm, lambda: Net(unused), opt_name, passes=passes,
                   fusion_threshold_bytes=256)


@pytest.mark.parametrize("kwargs, grad_scale, tol", [
    ({"gradient_predivide_factor": 2.0}, 1.0, 1e-4),
    ({"op": C.Sum}, None, 1e-4),
    ({"compression": C.Compression.fp16, "algorithm": "ring"}, 1.0, 1e-2),
])
def test_reduction_options(comm, kwargs, grad_scale, tol):
    scale = comm.Get_size() if grad_scale is None else grad_scale  # Sum = n x the average
    check_training(comm, Net, "sgd", steps=5, tol=tol, grad_scale=scale, dtype=torch.float32,
                   **kwargs)


@pytest.mark.mpi(min_size=2)
def test_rank_dependent_hook_order_does_not_deadlock(comm):
    model, opt, ref, ref_opt = setup(comm, Branches, "sgd", fusion_threshold_bytes=(IN * IN + IN) * 8)
    assert len(opt._buckets) == len(model.layers)  # one bucket per layer
    order: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: order.append(name))
    for step in range(4):
        order.clear()
        distributed_step(comm, model, opt, step)
        reference_step(comm.Get_size(), ref, ref_opt, step)
        assert max_diff(model, ref) <= FLOAT64_TRAINING
    orders = comm.allgather(order)
    assert orders[0] != orders[1], "the test needs hooks firing in rank-dependent orders"


def test_synchronize_clip_skip_synchronize(comm):
    check_training(comm, Net, "sgd", steps=5, clip=0.05)


def test_step_inside_skip_synchronize_needs_synchronize(comm):
    model, opt, *_ = setup(comm, Net, "sgd")
    x, y = batch(comm.Get_size(), 0, 0)
    shard_loss(model, x, y, comm.Get_rank()).backward()
    with opt.skip_synchronize(), pytest.raises(RuntimeError, match="synchronize"):
        opt.step()
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="backward_passes_per_step=1"):
        shard_loss(model, x, y, comm.Get_rank()).backward()
    opt.step()  # the first backward's reductions complete on every rank


def test_add_param_group(comm):
    """A group added later gets buckets of its own, reduced like the others."""
    torch.manual_seed(comm.Get_rank())
    model, ref = Net().double(), Net().double()
    broadcast_parameters(model.state_dict(), root_rank=0)
    ref.load_state_dict(model.state_dict())
    opt = DistributedOptimizer(torch.optim.SGD(model.body.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
    opt.add_param_group({"params": list(model.extra.parameters()), "lr": 0.1})
    ref_opt = torch.optim.SGD(ref.body.parameters(), lr=0.05)
    ref_opt.add_param_group({"params": list(ref.extra.parameters()), "lr": 0.1})
    for step in range(3):
        distributed_step(comm, model, opt, step)
        reference_step(comm.Get_size(), ref, ref_opt, step)
    assert max_diff(model, ref) <= FLOAT64_TRAINING


def test_state_dict_round_trip(comm):
    model, opt, *_ = setup(comm, Net, "adam")
    for step in range(3):
        distributed_step(comm, model, opt, step)
    assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state
    saved = copy.deepcopy(opt.state_dict())  # as if saved to a file: torch shares tensors
    twin = Net().double()
    twin.load_state_dict(model.state_dict())
    twin_opt = DistributedOptimizer(OPTIMIZERS["adam"](twin.parameters(), 7.0),
                                    named_parameters=twin.named_parameters())
    twin_opt.load_state_dict(saved)
    assert twin_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for a, b in zip(opt.state.values(), twin_opt.state.values(), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for step in range(3, 5):  # both continue identically
        distributed_step(comm, model, opt, step)
        distributed_step(comm, twin, twin_opt, step)
    assert torch.equal(flat_params(model), flat_params(twin))


@pytest.mark.parametrize("root", [0, -1])
def test_broadcast_optimizer_state_creates_lazy_state(comm, root):
    n, rank = comm.Get_size(), comm.Get_rank()
    root %= n
    torch.manual_seed(0)
    model = Net().double()
    opt = OPTIMIZERS["adam"](model.parameters(), 1.0 + rank)
    if rank == root:  # only root has stepped: the others have no Adam state yet
        for step in range(3):
            x, y = batch(1, step, 0)
            shard_loss(model, x, y, 0).backward()
            opt.step()
            opt.zero_grad()
    before = flat_params(model).clone()
    expected = comm.bcast(opt.state_dict() if rank == root else None, root=root)
    broadcast_optimizer_state(opt, root_rank=root)
    got = opt.state_dict()
    assert torch.equal(flat_params(model), before), "broadcasting state must not step"
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys() and len(got["state"]) > 0
    for index, state in expected["state"].items():
        assert state["step"].item() == 3, "step counters must not move"
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), f"state[{index}][{key!r}]"


def test_broadcast_before_first_step_keeps_state_empty(comm):
    model = Net().double()
    opt = OPTIMIZERS["adam"](model.parameters(), 1.0 + comm.Get_rank())
    broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state) == 0
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)


def test_bad_arguments_raise():
    model = Net()
    params = list(model.named_parameters())
    sgd = OPTIMIZERS["sgd"](model.parameters())

    def make(**kwargs):
        return DistributedOptimizer(sgd, **kwargs)

    with pytest.raises(ValueError, match=r"duplicate names \['body.0.weight'\]"):
        make(named_parameters=params + params[:1])
    with pytest.raises(ValueError, match=r"missing"):
        make(named_parameters=params[1:])
    with pytest.raises(ValueError, match="same tensor"):
        make(named_parameters=params + [("alias", params[0][1])])
    with pytest.raises(TypeError, match="named_parameters"):
        make(named_parameters=[1, 2])
    with pytest.raises(TypeError, match="optimizer"):
        DistributedOptimizer(model)
    for kwargs in [{"backward_passes_per_step": 0}, {"fusion_threshold_bytes": -1},
                   {"op": C.Max}, {"algorithm": "butterfly"}, {"compression": "fp16"},
                   {"gradient_predivide_factor": 0.0},
                   {"gradient_predivide_factor": 2.0, "op": C.Sum}]:
        name = "gradient_predivide_factor" if "gradient_predivide_factor" in kwargs else \
            next(iter(kwargs))
        with pytest.raises(ValueError, match=name):
            make(**kwargs)
    with pytest.raises(TypeError, match="params"):
        broadcast_parameters({"w": 1.0})
