"""ZeroOptimizer (optim/zero.py): stage 1 and 2 train as one process taking the global batch
does, for SGD with momentum, Adam and AdamW, with one bucket or many (shards that cut
parameters anywhere, uneven at every world size), param groups with their own
hyperparameters, frozen parameters and backward_passes_per_step; each rank keeps only its
shard of the optimizer state (and, in stage 2, of the gradients); checkpoints round-trip
as shards, resharded to another world size (a process set of another size), and
consolidated into a plain optimizer's state dict. GradScaler and parameters of two dtypes
with an LR scheduler are checked in stage 3 too (its other tests: test_zero3.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from collectives.optim import ZeroOptimizer
from collectives.optim.zero import IN_FLIGHT
from collectives.optim.zero_shards import part_of
from conftest import assert_same_on_all_ranks, rounding_bound
from test_optimizer import (
    FLOAT64_TRAINING,
    Net,
    batch,
    flat_params,
    max_diff,
    scaled_step,
    shard_loss,
)

import collectives as C

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}
TOL = FLOAT64_TRAINING  # float64 models (test_optimizer says how)


def _params(model: Net, groups: bool):
    if not groups:
        return [p for p in model.parameters() if p.requires_grad]
    return [{"params": list(model.body.parameters())},
            {"params": [p for p in model.extra.parameters() if p.requires_grad], "lr": 0.002,
             "momentum": 0.5, "betas": (0.8, 0.9)}]


def _make(opt_name: str, groups: bool):
    """A function of a model giving the plain optimizer over its trainable parameters."""
    make = OPTIMIZERS[opt_name]
    if not groups:
        return lambda model: make(_params(model, False))
    keep = {"params", "lr", *({"momentum"} if opt_name == "sgd" else {"betas"})}
    return lambda model: make([{n: v for n, v in g.items() if n in keep}
                               for g in _params(model, True)])


def _twins(opt_name: str, groups: bool = False, frozen: bool = False, **kwargs):
    """(model, its ZeroOptimizer, a copy, the copy's plain optimizer): alike on every rank."""
    torch.manual_seed(0)
    model = Net().double()
    if frozen:
        model.extra.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    make = _make(opt_name, groups)
    return model, ZeroOptimizer(make(model), **kwargs), ref, make(ref)


def _step(comm, model, opt, step: int, passes: int = 1) -> None:
    for micro in range(passes):
        x, y = batch(comm.Get_size(), step, micro)
        shard_loss(model, x, y, comm.Get_rank()).backward()
    opt.step()
    opt.zero_grad()


def _ref_step(n: int, ref, ref_opt, step: int, passes: int = 1) -> None:
    for micro in range(passes):
        x, y = batch(n, step, micro)
        (sum(shard_loss(ref, x, y, s) for s in range(n)) / n).backward()
    ref_opt.step()
    ref_opt.zero_grad()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("threshold", [64 << 20, 200])  # one bucket; many, cut anywhere
def test_trains_as_one_process(comm, stage, opt_name, threshold):
    model, opt, ref, ref_opt = _twins(opt_name, stage=stage, fusion_threshold_bytes=threshold)
    for step in range(4):
        _step(comm, model, opt, step)
        _ref_step(comm.Get_size(), ref, ref_opt, step)
        assert max_diff(model, ref) <= TOL, f"step {step}"
    assert_same_on_all_ranks(comm, flat_params(model).numpy(), "parameters")


@pytest.mark.parametrize("stage", [1, 2])
def test_groups_frozen_parameters_and_accumulation(comm, stage):
    for opt_name in ("sgd", "adam"):
        model, opt, ref, ref_opt = _twins(opt_name, groups=True, frozen=True, stage=stage,
                                          backward_passes_per_step=2,
                                          fusion_threshold_bytes=300)
        for step in range(3):
            _step(comm, model, opt, step, passes=2)
            _ref_step(comm.Get_size(), ref, ref_opt, step, passes=2)
            assert max_diff(model, ref) <= TOL, f"{opt_name} step {step}"
        assert opt.param_groups[1]["lr"] == 0.002
        assert model.extra.bias.grad is None


def test_each_rank_keeps_its_shard(comm):
    """The pieces cover every trainable element once over the ranks; stage 2 keeps no
    parameter gradient after backward, stage 1 keeps them all; at most IN_FLIGHT buckets'
    packed gradients are alive."""
    n = comm.Get_size()
    for stage in (1, 2):
        model, opt, _, _ = _twins("adam", stage=stage, fusion_threshold_bytes=500)
        total = sum(p.numel() for p in model.parameters())
        mine = sum(p.numel() for g in opt.param_groups for p in g["params"])
        assert comm.allreduce(mine) == total and mine <= -(-total // n) + len(opt._buckets)
        x, y = batch(n, 0, 0)
        shard_loss(model, x, y, comm.Get_rank()).backward()
        kept = [p.grad is not None for p in model.parameters()]
        assert all(kept) if stage == 1 else not any(kept)
        packed = sum(b.grad is not None for b in opt._buckets)  # launched, not finished
        assert len(opt._buckets) > IN_FLIGHT and packed <= IN_FLIGHT
        opt.step()
        state = sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim())
        assert state == 2 * mine  # Adam's two moments, over this rank's pieces only


def test_an_optimizer_with_state_is_refused(comm):
    model = Net().double()
    opt = torch.optim.Adam(model.parameters())
    x, y = batch(1, 0, 0)
    shard_loss(model, x, y, 0).backward()
    opt.step()
    with pytest.raises(ValueError, match="optimizer: expected a fresh optimizer"):
        ZeroOptimizer(opt)
    with pytest.raises(ValueError, match="stage: expected 1, 2 or 3"):
        ZeroOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1), stage=4)


@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoint_shards_and_consolidated(comm, stage):
    """Saved after 3 steps, loaded into fresh optimizers three ways (this rank's shard,
    every rank's shards, the consolidated dict; also into a plain optimizer), every copy
    goes on as the original does."""
    n = comm.Get_size()
    model, opt, ref, ref_opt = _twins("adam", groups=True, stage=stage,
                                      fusion_threshold_bytes=300)
    for step in range(3):
        _step(comm, model, opt, step)
        _ref_step(n, ref, ref_opt, step)
    mine = opt.state_dict()
    shards = C.allgather_object(mine)
    full = C.broadcast_object(opt.consolidated_state_dict(), root_rank=0)
    copies = []
    for saved in (mine, shards, full):
        twin, twin_opt, _, _ = _twins("adam", groups=True, stage=stage,
                                      fusion_threshold_bytes=300)
        twin.load_state_dict(model.state_dict())
        twin_opt.load_state_dict(saved)
        copies.append((twin, twin_opt))
    plain = Net().double()
    plain.load_state_dict(model.state_dict())
    plain_opt = _make("adam", True)(plain)
    plain_opt.load_state_dict(full)
    for step in range(3, 6):
        _step(comm, model, opt, step)
        for twin, twin_opt in copies:
            _step(comm, twin, twin_opt, step)
            assert max_diff(twin, model) == 0, f"step {step}"
        _ref_step(n, plain, plain_opt, step)
        assert max_diff(plain, model) <= TOL, f"step {step}"


@pytest.mark.mpi(min_size=3)
def test_resharding_to_another_world_size(comm):
    """Shards saved by every rank load into an optimizer over a process set of 2 ranks (or
    only their parts over its pieces: part_of), and its shards back into one over every
    rank: each consolidates to the same state."""
    model, opt, _, _ = _twins("adam", stage=2, fusion_threshold_bytes=300)
    for step in range(2):
        _step(comm, model, opt, step)
    shards = C.allgather_object(opt.state_dict())
    full = opt.consolidated_state_dict()
    pair = C.add_process_set([0, 1])
    try:
        if pair.included():
            small, small_opt, _, _ = _twins("adam", stage=2, process_set=pair,
                                            fusion_threshold_bytes=300)
            small_opt.load_state_dict(shards)
            small_shards = small_opt.state_dict()
            again = small_opt.consolidated_state_dict()
            # only the parts over its pieces (what an elastic job sends each rank): the same
            _, parted, _, _ = _twins("adam", stage=2, process_set=pair,
                                     fusion_threshold_bytes=300)
            parts = [part_of(shard, parted.placement) for shard in shards]
            assert sum(len(g) for p in parts for g in p["placement"]) > len(shards)
            parted.load_state_dict(parts)
            mine, theirs = small_shards["optimizer"]["state"], parted.state_dict()["optimizer"]["state"]
            assert mine.keys() == theirs.keys()
            for index, entry in mine.items():
                for key, value in entry.items():
                    assert torch.equal(value, theirs[index][key]), (index, key)
        else:
            small_shards, again = None, None
        small_shards = [s for s in C.allgather_object(small_shards) if s is not None]
        assert [s["world_size"] for s in small_shards] == [2, 2]
        big, big_opt, _, _ = _twins("adam", stage=2, fusion_threshold_bytes=300)
        big_opt.load_state_dict(small_shards)
        back = big_opt.consolidated_state_dict()
        if comm.Get_rank() == 0:
            for other in (again, back):
                assert other["param_groups"] == full["param_groups"]
                assert full["state"].keys() == other["state"].keys()
                for index, entry in full["state"].items():
                    for key, value in entry.items():
                        assert torch.equal(value, other["state"][index][key]), (index, key)
    finally:
        C.remove_process_set(pair)


@pytest.mark.parametrize("compression", ["fp16", "int8", "int4", "onebit"])
def test_compression(comm, compression):
    """Gradients reduce-scattered compressed: close to the uncompressed run, not equal to
    it, and alike on every rank."""
    n = comm.Get_size()
    model, opt, ref, ref_opt = _twins("sgd", compression=getattr(C.Compression, compression,
                                                                 compression),
                                      fusion_threshold_bytes=300)
    for step in range(3):
        _step(comm, model, opt, step)
        _ref_step(n, ref, ref_opt, step)
    tol = {"fp16": 1e-3, "int8": 2e-2, "int4": 0.1, "onebit": 0.1}[compression]
    assert 0 < max_diff(model, ref) <= tol
    assert_same_on_all_ranks(comm, flat_params(model).numpy(), "parameters")
    with pytest.raises(ValueError, match="compression: expected Compression.none, fp16, int8, "
                                         "int4 or"):
        ZeroOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1), compression="int4")


def _module(stage: int, model: torch.nn.Module) -> dict:
    """ZeroOptimizer's arguments for the model at this stage (stage 3 gathers its units)."""
    return {"stage": stage, **({"module": model} if stage == 3 else {})}


@pytest.mark.parametrize("stage", [2, 3])
def test_grad_scaler_after_synchronize(comm, stage):
    """GradScaler unscales the pieces' reduced gradients (synchronize first, then step
    inside skip_synchronize), as a plain optimizer's with one process."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), **_module(stage, model))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0), \
        torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(3):
        scaled_step(comm, model, opt, ref, ref_opt, (scaler, ref_scaler), step, torch.float32)
        with opt.gathered():
            assert max_diff(model, ref) <= 1e-5, f"step {step}"
    assert scaler.get_scale() == ref_scaler.get_scale()


class _TwoDtypes(torch.nn.Module):
    """Parameters of two dtypes (float32 and float64: one bucket each), odd sizes."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(5, 3))
        self.b = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
        self.c = torch.nn.Parameter(torch.randn(1))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return ((x[:, :5].float() @ self.a).tanh().sum() * self.c).double().sum() \
            + (x[:, :7] * self.b).sin().sum()


class _TwoDtypeUnits(torch.nn.Module):
    """A float32 layer and a float64 layer, each a unit of stage 3, odd sizes."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 3)
        self.b = torch.nn.Linear(3, 7).double()

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x[:, :5].float()).tanh().double()).sin().sum()


@pytest.mark.parametrize("stage", [2, 3])
def test_several_dtypes_and_an_lr_scheduler(comm, stage):
    n, r = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    model = _TwoDtypes() if stage == 2 else _TwoDtypeUnits()
    ref = copy.deepcopy(model)
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), **_module(stage, model))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    assert {b.flat.dtype for b in opt._buckets} == {torch.float32, torch.float64}
    moved = 0.0  # the lr summed over the steps so far: Adam moves a parameter <= ~lr a step
    for step in range(5):
        moved += ref_opt.param_groups[0]["lr"]
        x = torch.randn(4 * n, 8 if stage == 2 else 5, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(step))
        model.loss(x[4 * r:4 * r + 4]).backward()
        opt.step()
        opt.zero_grad()
        sum(ref.loss(x[4 * s:4 * s + 4]) for s in range(n)).div(n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        sched.step()
        ref_sched.step()
        # The float64 parameters' gradients come from float32 values (the float32 layer
        # feeds them), computed by whichever SIMD kernels torch picks, in another order
        # for a shard than for the whole batch: each gradient carries float32 roundings,
        # 64 of them budgeted (a 5-term dot product, tanh, the cast, and the float32
        # parameters' last-bit differences after 5 steps, several times over), and Adam's
        # m / (sqrt(v) + eps) passes a gradient's relative error on at most doubled into
        # its step. The float32 parameters also round each step's update to their own
        # last bit (2 u |q| a step).
        update = rounding_bound(torch.float32, 2 * 64, moved)
        with opt.gathered():
            for p, q in zip(model.parameters(), ref.parameters()):
                own = 0.0 if p.dtype == torch.float64 else \
                    rounding_bound(torch.float32, 2 * (step + 1), q.abs().max().item())
                assert (p - q).abs().max().item() <= update + own, (step, p.dtype)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.01 * 0.25


def test_fewer_elements_than_ranks_and_a_process_set(comm):
    """A 3-element model: some ranks own nothing and still take part. Over a process set
    of the even ranks, the set trains as one process with its batch."""
    n, r = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))
    ref = w.detach().clone().requires_grad_()
    opt = ZeroOptimizer(torch.optim.SGD([w], lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    for step in range(3):
        (w * (r + step)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        (sum((ref * (q + step)).pow(2).sum() for q in range(n)) / n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert (w - ref).abs().max().item() <= TOL
    evens = C.add_process_set(range(0, n, 2))
    try:
        if evens.included():
            m = evens.size()
            model, opt, ref, ref_opt = _twins("adam", process_set=evens,
                                              fusion_threshold_bytes=300)
            for step in range(3):
                x, y = batch(m, step, 0)
                shard_loss(model, x, y, evens.rank()).backward()
                opt.step()
                opt.zero_grad()
                _ref_step(m, ref, ref_opt, step)
                assert max_diff(model, ref) <= TOL
    finally:
        C.remove_process_set(evens)


def test_a_sparse_gradient_is_refused(comm):
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = ZeroOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="ZeroOptimizer: the gradient of a parameter of "
                                           "shape \\(10, 3\\) is sparse"):
        emb(torch.tensor([1, 2])).sum().backward()
    del opt


def test_onebit_error_buffers_are_checkpointed(comm):
    """1-bit's error buffers are in the shard: a copy loaded from the shards goes on
    bitwise; loaded from the consolidated dict (no buffers) it restarts them at zeros and
    goes on differently."""
    model, opt, _, _ = _twins("adam", stage=2, compression="onebit", fusion_threshold_bytes=300)
    for step in range(2):
        _step(comm, model, opt, step)
    assert any(b.error.abs().max() > 0 for b in opt._buckets)
    shards = C.allgather_object(opt.state_dict())
    full = C.broadcast_object(opt.consolidated_state_dict(), root_rank=0)
    copies = []
    for saved in (shards, full):
        twin, twin_opt, _, _ = _twins("adam", stage=2, compression="onebit",
                                      fusion_threshold_bytes=300)
        twin.load_state_dict(model.state_dict())
        twin_opt.load_state_dict(saved)
        copies.append(twin)
        for step in range(2, 4):
            _step(comm, twin, twin_opt, step)
    for step in range(2, 4):
        _step(comm, model, opt, step)
    assert max_diff(copies[0], model) == 0 and max_diff(copies[1], model) > 0
