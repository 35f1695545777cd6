"""ZeroOptimizer stage 3 (optim/zero.py, optim/zero3.py): parameters sharded too, each unit
gathered around its forward and backward. It trains as one process taking the global batch
does (SGD with momentum, Adam, AdamW; the default units, units of single layers with
parameters left whole, prefetch and resharding on and off, tied weights, gradient
accumulation, param groups, frozen parameters, compression, pieces empty on some ranks);
between steps a rank holds only its pieces, and while training at most the units that
prefetch allows; checkpoints carry the parameters, reshard to another world size and
consolidate into a plain model and optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
from collectives.optim import ZeroOptimizer
from conftest import assert_same_on_all_ranks
from test_optimizer import Net, batch, flat_params, shard_loss
from test_zero import OPTIMIZERS, TOL, _make, _ref_step, _step

import collectives as C


def _twins(opt_name: str = "adam", groups: bool = False, frozen: bool = False,
           units=None, **kwargs):
    """(model, its stage-3 ZeroOptimizer, a copy, the copy's plain optimizer)."""
    torch.manual_seed(0)
    model = Net().double()
    if frozen:
        model.extra.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    make = _make(opt_name, groups)
    chosen = None if units is None else units(model)
    return model, ZeroOptimizer(make(model), stage=3, module=model, units=chosen,
                                **kwargs), ref, make(ref)


def _diff(model, opt, ref) -> float:
    with opt.gathered():
        return (flat_params(model) - flat_params(ref)).abs().max().item()


LAYERS = lambda m: [m.body[0], m.body[2]]  # noqa: E731  (extra stays whole)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("units", [None, LAYERS], ids=["children", "layers"])
@pytest.mark.parametrize("prefetch, reshard", [(True, True), (False, False)])
def test_trains_as_one_process(comm, opt_name, units, prefetch, reshard):
    model, opt, ref, ref_opt = _twins(opt_name, units=units, prefetch=prefetch,
                                      reshard_after_forward=reshard)
    for step in range(4):
        _step(comm, model, opt, step)
        _ref_step(comm.Get_size(), ref, ref_opt, step)
        assert _diff(model, opt, ref) <= TOL, f"step {step}"
    with opt.gathered():
        assert_same_on_all_ranks(comm, flat_params(model).numpy(), "parameters")


def test_a_rank_holds_its_pieces_and_the_units_prefetch_allows(comm):
    """Backward leaves no parameter gradient (each is reduce-scattered into its owners'
    pieces); between steps no sharded parameter has memory and the pieces cover every
    element once over the ranks; during a step the gathered bytes peak at the two largest
    neighbouring units with prefetch, at the largest alone without."""
    n = comm.Get_size()
    for prefetch in (True, False):
        model, opt, _, _ = _twins(units=LAYERS, prefetch=prefetch)
        sharded = [model.body[0].weight, model.body[0].bias, model.body[2].weight,
                   model.body[2].bias]
        total = sum(p.numel() for p in model.parameters())
        mine = sum(p.numel() for g in opt.param_groups for p in g["params"])
        assert comm.allreduce(mine) == total
        x, y = batch(n, 0, 0)
        shard_loss(model, x, y, comm.Get_rank()).backward()
        assert all(p.grad is None for p in model.parameters())  # reduce-scattered, freed
        opt.step()
        opt.zero_grad()
        for step in range(1, 3):
            _step(comm, model, opt, step)
            assert all(p.untyped_storage().nbytes() == 0 for p in sharded)
            assert model.extra.weight.untyped_storage().nbytes() > 0  # whole
            assert opt.gathered_bytes == 0
        unit_bytes = [sum(p.numel() * 8 for p in m.parameters()) for m in LAYERS(model)]
        assert opt.peak_gathered_bytes == (sum(unit_bytes) if prefetch else max(unit_bytes))
        state = sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim())
        assert state == 2 * mine and mine <= -(-total // n) + 3


class _Tied(torch.nn.Module):
    """An embedding-like input layer and an output layer sharing one weight, each a unit."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 6, bias=False)
        self.mid = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 6, bias=True)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.inp(x).tanh()).tanh())


def test_tied_weights_stay_whole_and_train(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    model = _Tied().double()
    ref = copy.deepcopy(model)
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), stage=3, module=model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(3 * n, 6, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(step))
        model(x[3 * r:3 * r + 3]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        (sum(ref(x[3 * s:3 * s + 3]).pow(2).mean() for s in range(n)) / n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with opt.gathered():
            assert max((p - q).abs().max().item()
                       for p, q in zip(model.parameters(), ref.parameters())) <= TOL
    assert model.inp.weight.untyped_storage().nbytes() > 0  # tied: whole
    assert model.mid.weight.untyped_storage().nbytes() == 0


def test_groups_frozen_parameters_accumulation_and_eval(comm):
    """Two backward passes a step, a param group of its own, a frozen bias; an evaluation
    forward under no_grad between steps sees the current parameters and changes nothing."""
    for opt_name in ("sgd", "adam"):
        model, opt, ref, ref_opt = _twins(opt_name, groups=True, frozen=True,
                                          backward_passes_per_step=2)
        for step in range(3):
            _step(comm, model, opt, step, passes=2)
            _ref_step(comm.Get_size(), ref, ref_opt, step, passes=2)
            x, _ = batch(comm.Get_size(), 9, 0)
            with torch.no_grad():
                assert torch.equal(model(x, 0), ref(x, 0)) or \
                    (model(x, 0) - ref(x, 0)).abs().max().item() <= TOL
            assert _diff(model, opt, ref) <= TOL, f"{opt_name} step {step}"
        assert opt.param_groups[1]["lr"] == 0.002
        assert model.extra.bias.grad is None


@pytest.mark.parametrize("compression", ["fp16", "int8", "onebit"])
def test_compression(comm, compression):
    n = comm.Get_size()
    model, opt, ref, ref_opt = _twins("sgd", compression=getattr(C.Compression, compression,
                                                                 compression))
    for step in range(3):
        _step(comm, model, opt, step)
        _ref_step(n, ref, ref_opt, step)
    tol = {"fp16": 1e-3, "int8": 2e-2, "onebit": 0.1}[compression]
    assert 0 < _diff(model, opt, ref) <= tol
    with opt.gathered():
        assert_same_on_all_ranks(comm, flat_params(model).numpy(), "parameters")


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("quantized", ["fp16", "int8", "int4"])
def test_parameters_gathered_quantized(comm, quantized, stage):
    """float32 parameters gathered as float16, or int8 or int4 with a scale per block (any
    stage; at np 3 the pieces have odd lengths, so int4 pieces end in half a byte):
    every rank computes with the same decoded values, within the format's error of the
    float32 master pieces the optimizer steps, and the model still trains as one process
    does, within that error; a shard saved and loaded gives the masters back bit for bit."""
    n = comm.Get_size()
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    extra = {"module": model} if stage == 3 else {}
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                        stage=stage, parameter_compression=getattr(C.Compression, quantized),
                        **extra)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x, y = batch(n, step, 0, torch.float32)
        shard_loss(model, x, y, comm.Get_rank()).backward()
        opt.step()
        opt.zero_grad()
        (sum(shard_loss(ref, x, y, s) for s in range(n)) / n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    sharded = [b for b in opt._buckets if hasattr(b, "shard")]
    masters = torch.cat([torch.cat(C.allgather_object(b.shard)) for b in sharded])
    with opt.gathered():
        decoded = torch.cat([b.flat.clone() for b in sharded])
        assert_same_on_all_ranks(comm, flat_params(model).numpy(), "parameters")
        diff = (flat_params(model) - flat_params(ref)).abs().max().item()
    error = (decoded - masters).abs().max().item()
    largest = masters.abs().max().item()
    bound = {"fp16": 1e-3, "int8": largest / 127, "int4": largest / 7}[quantized]
    assert 0 < error <= bound
    assert diff <= 0.05 + bound
    if stage == 3:
        return
    again = copy.deepcopy(ref)
    loaded = ZeroOptimizer(torch.optim.SGD(again.parameters(), lr=0.05, momentum=0.9),
                           stage=stage, parameter_compression=getattr(C.Compression, quantized))
    loaded.load_state_dict(opt.state_dict())
    for b, c in zip(sharded, [b for b in loaded._buckets if hasattr(b, "shard")]):
        assert torch.equal(b.shard, c.shard) and torch.equal(b.flat, c.flat)


def test_hpz_keeps_node_pieces_for_the_backward(comm):
    """hpz=True: each unit's forward keeps this rank's piece of it among its node's ranks,
    the backward gathers from those over the node alone, and training is bit for bit the
    same as without (the same values are gathered); the pieces are dropped once used."""
    runs = []
    for hpz in (False, True):
        model, opt, _, _ = _twins("adam", hpz=hpz)
        sharded = [b for b in opt._buckets if hasattr(b, "shard")]
        for step in range(3):
            x, y = batch(comm.Get_size(), step, 0)
            loss = shard_loss(model, x, y, comm.Get_rank())
            kept = [b.secondary is not None for b in sharded]
            assert all(kept) if hpz else not any(kept)
            # the units are freed after the forward: what is held is the kept pieces
            assert opt.gathered_bytes == sum(b.secondary.numel() * b.secondary.element_size()
                                             for b in sharded if b.secondary is not None)
            loss.backward()
            assert not any(b.secondary is not None for b in sharded)
            assert opt.gathered_bytes == 0
            opt.step()
            opt.zero_grad()
        with opt.gathered():
            runs.append(flat_params(model))
    assert torch.equal(runs[0], runs[1])
    if C.cross_size() > 1:
        node = opt._sharded.node_set
        assert node is not None and node.size() == C.local_size()
        _, again, _, _ = _twins("adam", hpz=True)
        assert again._sharded.node_set is node  # the node sets are registered once a job
    with pytest.raises(ValueError, match="hpz: over the whole job only"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=3, module=model,
                      hpz=True, process_set=C.global_process_set)


@pytest.mark.parametrize("quantized", ["fp16", "int8", "int4"])
def test_hpz_with_quantized_parameters(comm, quantized):
    """hpz=True with parameters gathered quantized: the backward gathers the node's kept
    pieces, the values the forward decoded (float32), and training is bit for bit the same
    as without hpz."""
    runs = []
    for hpz in (False, True):
        torch.manual_seed(0)
        model = Net()
        opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), stage=3,
                            module=model, hpz=hpz,
                            parameter_compression=getattr(C.Compression, quantized))
        for step in range(3):
            x, y = batch(comm.Get_size(), step, 0, torch.float32)
            shard_loss(model, x, y, comm.Get_rank()).backward()
            opt.step()
            opt.zero_grad()
        with opt.gathered():
            runs.append(flat_params(model))
    assert torch.equal(runs[0], runs[1])


def test_checkpoints_carry_the_parameters(comm):
    """After 3 steps: this rank's shard, or every rank's shards, restore a model freshly
    initialized otherwise (parameters and optimizer state): it goes on bitwise as the
    original; model_state_dict() and consolidated_state_dict() load into a plain model and
    optimizer that go on as one process."""
    n = comm.Get_size()
    model, opt, _, _ = _twins("adam", groups=True)
    for step in range(3):
        _step(comm, model, opt, step)
    mine, shards = opt.state_dict(), C.allgather_object(opt.state_dict())
    full = C.broadcast_object(opt.consolidated_state_dict(), root_rank=0)
    weights = opt.model_state_dict()
    copies = []
    for saved in (mine, shards):
        torch.manual_seed(1)  # other initial values: the checkpoint must bring them
        twin = Net().double()
        twin_opt = ZeroOptimizer(_make("adam", True)(twin), stage=3, module=twin)
        twin_opt.load_state_dict(saved)
        copies.append((twin, twin_opt))
    plain = Net().double()
    plain.load_state_dict(weights)
    plain_opt = _make("adam", True)(plain)
    plain_opt.load_state_dict(full)
    for step in range(3, 5):
        _step(comm, model, opt, step)
        for twin, twin_opt in copies:
            _step(comm, twin, twin_opt, step)
            with opt.gathered(), twin_opt.gathered():
                assert torch.equal(flat_params(twin), flat_params(model)), f"step {step}"
        _ref_step(n, plain, plain_opt, step)
        assert _diff(model, opt, plain) <= TOL, f"step {step}"


@pytest.mark.mpi(min_size=3)
def test_resharding_to_another_world_size(comm):
    """Shards saved by every rank load into a stage-3 optimizer over 2 ranks: it holds the
    same parameters and goes on as the original over its own batch."""
    model, opt, _, _ = _twins("adam")
    for step in range(2):
        _step(comm, model, opt, step)
    shards = C.allgather_object(opt.state_dict())
    weights = opt.model_state_dict()
    pair = C.add_process_set([0, 1])
    try:
        if pair.included():
            torch.manual_seed(2)
            small = Net().double()
            small_opt = ZeroOptimizer(_make("adam", False)(small), stage=3, module=small,
                                      process_set=pair)
            small_opt.load_state_dict(shards)
            got = small_opt.model_state_dict()
            assert all(torch.equal(got[k], weights[k]) for k in weights)
            full = small_opt.consolidated_state_dict()
            if pair.rank() == 0:
                ref = Net().double()
                ref.load_state_dict(weights)
                ref_opt = _make("adam", False)(ref)
                ref_opt.load_state_dict(full)
            for step in range(2, 4):
                x, y = batch(2, step, 0)
                shard_loss(small, x, y, pair.rank()).backward()
                small_opt.step()
                small_opt.zero_grad()
                if pair.rank() == 0:
                    _ref_step(2, ref, ref_opt, step)
            got = small_opt.model_state_dict()
            if pair.rank() == 0:
                assert max((got[k] - v).abs().max().item()
                           for k, v in ref.state_dict().items()) <= TOL
    finally:
        C.remove_process_set(pair)


def test_fewer_elements_than_ranks(comm):
    """Units smaller than the world: some ranks' pieces are empty, they still gather."""
    n, r = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 2)).double()
    ref = copy.deepcopy(model)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), stage=3,
                        module=model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        xs = [torch.full((1, 1), float(q + step), dtype=torch.float64) for q in range(n)]
        model(xs[r]).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        (sum(ref(x).pow(2).sum() for x in xs) / n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with opt.gathered():
            assert (flat_params(model) - flat_params(ref)).abs().max().item() <= TOL


def test_a_layer_outside_its_unit_or_a_replaced_parameter_is_a_clear_error(comm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()),
                                torch.nn.Linear(4, 2))
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=3, module=model)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="Linear '0' of unit Sequential ran while the unit "
                                           "is not gathered"):
        model[0][0](x)
    model(x).sum().backward()  # through the units: fine
    opt.step()
    with opt.gathered():
        assert model[0][0](x).shape == (2, 4)
    model[1].weight = torch.nn.Parameter(torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="parameter 'weight' of a Linear in unit Linear was "
                                           "replaced after wrapping"):
        model(x)


def test_bad_arguments(comm):
    model = Net().double()
    with pytest.raises(TypeError, match="module: stage 3 needs the model"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    with pytest.raises(ValueError, match="module, units, hpz: for stage=3"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=2, module=model)
    with pytest.raises(ValueError, match="units: expected submodules of module"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=3, module=model,
                      units=[torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="module: the optimizer has parameters"):
        ZeroOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1), stage=3, module=model)
    with pytest.raises(ValueError, match="parameter_compression: expected Compression.none"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=3, module=model,
                      parameter_compression="onebit")
    opt = ZeroOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1), stage=2)
    with pytest.raises(RuntimeError, match="model_state_dict\\(\\): for stage=3"):
        opt.model_state_dict()
    from collectives.elastic import TorchState
    three = Net().double()
    opt = ZeroOptimizer(torch.optim.SGD(three.parameters(), lr=0.1), stage=3, module=three)
    with pytest.raises(ValueError, match="optimizer: a ZeroOptimizer in an elastic state must "
                                         "be of stage 1 or 2"):
        TorchState(model=three, optimizer=opt)
