"""torch.compile on the "collectives" backend, in the forms users meet: `torch.compile(DDP(m))`
(DDPOptimizer, and the python reducer with compiled autograd), with our DDP communication
hooks, `DDP(torch.compile(m))`, `no_sync()` accumulation, FSDP2 per layer (eager and
compiled, AVG, bf16 mixed precision; the CPU cases of PyTorch's own FSDP2 training
tests; gradient clipping, frozen weights, accumulation without sync, the full state dict
gathered and loaded from rank 0), a compiled model under `DistributedOptimizer`,
`ZeroOptimizer` (stages 1-3) and `OnebitAdam`, and a compiled DDP step after an elastic
shrink. Each trains a model with buffers (BatchNorm) and a transformer block a few steps
and is checked against a float64 one-process replay of the same global batches
(_Replay), with replicas bit-identical on every rank.

At np 2 and 3 only (but AT_NP_4): compiling costs seconds a graph on this machine, np 1
runs no exchange and np 4 adds nothing np 3 does not (an odd size, several peers). The DDP
forms (NP_2_ONLY) run at np 2 alone: each rank has ROWS rows at every size, so their graphs
and buckets are the same at np 3, and DDP's allreduce of a bucket at np 3 is
test_ddp_hooks.py's; np 3 runs the forms that shard (FSDP2, ZeroOptimizer), whose shards
are uneven at an odd size."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from collectives.optim import DistributedOptimizer, OnebitAdam, ZeroOptimizer
from conftest import FLOAT32_TRAINING, assert_same_on_all_ranks
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import collectives as C
from collectives.integrations.ddp_hooks import OnebitHookState, fp16_hook, int8_hook, onebit_hook

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() not in (2, 3, 4),
                                reason="compile forms run at np 2 and 3")
#: the tests that run at np 4 too (and only they): they need a world size with a divisor
AT_NP_4 = {"test_fsdp2_reshards_to_a_smaller_group_after_forward"}
#: the forms whose graphs, buckets and exchanges np 3 runs as np 2 does (the docstring)
NP_2_ONLY = {"test_compile_of_ddp",
             "test_compile_of_ddp_with_the_python_reducer_and_compiled_autograd",
             "test_ddp_of_a_compiled_model_and_no_sync_accumulation",
             "test_compile_of_ddp_with_our_hooks", "test_ddp_optimizer_splits_the_graph_at_our_buckets"}

ROWS = 8  # each rank's rows of a global batch (the same at every size: one set of graphs)
STEPS = 4
LR = 0.1


@pytest.fixture(scope="module", autouse=True)
def group():
    dist.init_process_group("collectives")
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_dynamo(request):
    """Each form compiles its own graphs (dynamo's caches and options reset around it)."""
    size, name = MPI.COMM_WORLD.Get_size(), request.node.originalname
    if size == 4 and name not in AT_NP_4:
        pytest.skip("compile forms run at np 2 and 3")
    if size == 3 and name in NP_2_ONLY:
        pytest.skip("a DDP form: np 3 compiles and exchanges what np 2 does")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(optimize_ddp=True, compiled_autograd=False):
        yield
    torch._dynamo.reset()


class _BatchNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # (no bias before BatchNorm: its gradient is zero but for rounding, which Adam's
        # normalized step would blow up to a step of lr either way)
        self.a, self.bn, self.b = torch.nn.Linear(8, 16, bias=False), \
            torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))

    def units(self) -> list[torch.nn.Module]:
        return [self.a, self.bn, self.b]


class _Block(torch.nn.Module):
    """A pre-norm transformer encoder block over 2 tokens of 8 features (no biases in the
    block: the keys' bias has a zero gradient but for rounding, see _BatchNormNet)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.block = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                                      norm_first=True, bias=False)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.block(self.embed(x.view(x.shape[0], 2, 4))).mean(1))

    def units(self) -> list[torch.nn.Module]:
        return [self.embed, self.block, self.head]


MODELS = {"batchnorm": _BatchNormNet, "transformer": _Block}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS * n, 8, generator=g), torch.randn(ROWS * n, 3, generator=g)


def _mine(step: int, r: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step, n)
    return x[ROWS * r:ROWS * (r + 1)], y[ROWS * r:ROWS * (r + 1)]


class _Replay:
    """The float64 one-process replay of ranks training on their rows of each global
    batch: each rank's loss on its rows, the gradients averaged over ranks; every rank's
    buffers (BatchNorm's running statistics) updated by its own rows, from rank 0's where
    DDP broadcasts them (broadcast_buffers: at a forward that follows one outside
    no_sync(), so at a step's first micro-batch), from its own otherwise."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, n: int, broadcast: bool):
        self.model, self.n, self.broadcast = copy.deepcopy(model).double(), n, broadcast
        self.forward: Any = self.model  # what a step calls (replaced to call a part)
        self.opt = optimizer(self.model.parameters())
        self.buffers = [[b.clone() for b in self.model.buffers()] for _ in range(n)]

    def step(self, step: int, micro_batches: int = 1) -> None:
        x, y = (t.double() for t in _batch(step, self.n))
        self.opt.zero_grad()
        for part in range(micro_batches):
            if self.broadcast and part == 0:  # not after a no_sync() forward
                self.buffers = [[b.clone() for b in self.buffers[0]] for _ in range(self.n)]
            for j in range(self.n):
                rows = torch.arange(ROWS * j, ROWS * (j + 1)).chunk(micro_batches)[part]
                self._load(j)
                loss = torch.nn.functional.mse_loss(self.forward(x[rows]), y[rows])
                (loss / (self.n * micro_batches)).backward()
                self.buffers[j] = [b.clone() for b in self.model.buffers()]
        self.opt.step()

    def _load(self, j: int) -> None:
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), self.buffers[j]):
                b.copy_(saved)

    def check(self, comm, model: torch.nn.Module, tolerance: dict = FLOAT32_TRAINING,
              what: str = "") -> None:
        """model's parameters and buffers are this rank's replay's, and its parameters
        the same bits on every rank."""
        self._load(comm.Get_rank())
        expected = self.model.state_dict()
        for name, value in model.state_dict().items():
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            if not value.is_floating_point():
                assert torch.equal(value, expected[name]), (what, name)
                continue
            torch.testing.assert_close(value.double(), expected[name], **tolerance,
                                       msg=lambda m, name=name: f"{what} {name}: {m}")
        for p in model.parameters():
            p = p.full_tensor() if hasattr(p, "full_tensor") else p
            # (a copy: numpy's view would pin the storage that stage 3 frees after)
            assert_same_on_all_ranks(comm, p.detach().float().clone().numpy(), what)


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _train(comm, run, opt, replay: _Replay, micro_batches: int = 1,
           no_sync: Any = None, steps: range = range(STEPS)) -> None:
    """The steps of run (the model as called) and opt, and of the replay; with
    micro_batches > 1 the gradients accumulate over them (inside no_sync() but the last)."""
    r, n = comm.Get_rank(), comm.Get_size()
    for step in steps:
        x, y = _mine(step, r, n)
        opt.zero_grad()
        for part, (xs, ys) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            last = part == micro_batches - 1
            with (no_sync() if no_sync is not None and not last else nullcontext()):
                loss = torch.nn.functional.mse_loss(run(xs), ys) / micro_batches
                loss.backward()
        opt.step()
        replay.step(step, micro_batches)


# ------------------------------------------------------------------------------ DDP
@pytest.mark.parametrize("model_name", list(MODELS))
def test_compile_of_ddp(comm, model_name):
    """torch.compile(DDP(m)), torch's recommended form: dynamo splits the graph at DDP's
    bucket boundaries (DDPOptimizer) and DDP's forward (its buffer broadcast into our
    group) runs between the compiled pieces."""
    model = _model(model_name)
    replay = _Replay(model, _sgd, comm.Get_size(), broadcast=True)
    ddp = DDP(model)
    _train(comm, torch.compile(ddp), _sgd(ddp.parameters()), replay)
    replay.check(comm, model, what=f"compile(DDP) {model_name}")


@pytest.mark.parametrize("model_name", list(MODELS))
def test_compile_of_ddp_with_the_python_reducer_and_compiled_autograd(comm, model_name):
    """optimize_ddp="python_reducer" with compiled autograd: DDP's gradient reductions are
    traced into the compiled backward as functional collectives on our group. DDP does not
    broadcast buffers in this mode (on gloo neither): each rank keeps its own."""
    model = _model(model_name)
    replay = _Replay(model, _sgd, comm.Get_size(), broadcast=False)
    with torch._dynamo.config.patch(optimize_ddp="python_reducer", compiled_autograd=True):
        ddp = DDP(model)  # (DDP reads the mode when made)
        _train(comm, torch.compile(ddp), _sgd(ddp.parameters()), replay)
    replay.check(comm, model, what=f"python reducer {model_name}")


@pytest.mark.parametrize("model_name", list(MODELS))
def test_ddp_of_a_compiled_model_and_no_sync_accumulation(comm, model_name):
    """DDP(torch.compile(m)), and torch.compile(DDP(m)) accumulating two micro-batches
    with the first inside no_sync()."""
    for form in ("DDP(compile)", "compile(DDP) no_sync"):
        model = _model(model_name)
        replay = _Replay(model, _sgd, comm.Get_size(), broadcast=True)
        if form == "DDP(compile)":
            ddp = DDP(torch.compile(model))
            _train(comm, ddp, _sgd(ddp.parameters()), replay)
        else:
            ddp = DDP(model)
            _train(comm, torch.compile(ddp), _sgd(ddp.parameters()), replay,
                   micro_batches=2, no_sync=ddp.no_sync)
        replay.check(comm, model, what=f"{form} {model_name}")


#: How far a hook's average lies from the exact one, relative to the bucket's largest
#: gradient, and how many of SGD's steps carry it (momentum 0.9: 1 + 1.9 + 2.71 + 3.44 =
#: 9.05 over 4 steps, times LR): fp16 rounds each rank's gradient and each partial sum
#: once (n + 1 <= 4 roundings of u = 2**-11); int8 rounds to half of a block's scale
#: (max / 127) and again after the sum (n + 1 <= 4 half steps).
_HOOK_ERROR = {"fp16": 4 * 2.0 ** -11, "int8": 4 * 0.5 / 127}


def _compressed_calls() -> int:
    return sum(op["calls"] for name, op in C.stats()["per_op"].items()
               if name.startswith("compressed_allreduce"))


@pytest.mark.parametrize("hook", ["fp16", "int8", "onebit"])
def test_compile_of_ddp_with_our_hooks(comm, hook):
    """torch.compile(DDP(m)) with each of our hooks registered: the hook reduces every
    bucket of every step (counted); fp16 and int8 stay within their rounding of the
    replay; 1-bit matches it through its uncompressed warm-up (2 steps), then makes one
    compressed call a bucket a step, with replicas the same bits."""
    calls = []
    chosen = {"fp16": fp16_hook, "int8": int8_hook, "onebit": onebit_hook}[hook]

    def counted(state, bucket):
        calls.append(bucket.index())
        return chosen(state, bucket)

    model = _model("transformer")
    replay = _Replay(model, _sgd, comm.Get_size(), broadcast=True)
    ddp = DDP(model)
    ddp.register_comm_hook(OnebitHookState(warmup_steps=2) if hook == "onebit" else None,
                           counted)
    run, opt = torch.compile(ddp), _sgd(ddp.parameters())
    if hook == "onebit":
        _train(comm, run, opt, replay, steps=range(2))
        replay.check(comm, model, what="onebit hook's warm-up")
        before, warm = _compressed_calls(), len(calls)
        _train(comm, run, opt, replay, steps=range(2, STEPS))
        assert _compressed_calls() - before == len(calls) - warm == warm, (calls, before)
        for p in model.parameters():
            assert_same_on_all_ranks(comm, p.detach().numpy(), "onebit hook")
    else:
        _train(comm, run, opt, replay)
        largest = max(p.grad.abs().max().item() for p in model.parameters())
        bound = _HOOK_ERROR[hook] * 9.05 * LR * max(largest, 1.0)
        replay.check(comm, model, {"rtol": 0, "atol": bound}, f"{hook} hook")
    assert calls and len(calls) == STEPS * len(set(calls)), calls  # every bucket, step


# ------------------------------------------------------------------------------ FSDP2
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("compiled", [False, True])
def test_fsdp2_per_layer_averages(comm, model_name, compiled):
    """fully_shard on each unit and on the model, eager and compiled: its gradient
    reduce-scatters on our group average (ReduceOp.AVG: one job once summed silently
    there), then with bf16 MixedPrecisionPolicies (parameters gathered in bf16, gradients
    reduced in bf16 or in float32, within bf16's rounding of the replay). Not on BatchNorm: torch's CPU
    batch_norm refuses bf16 weights beside float32 running statistics (on gloo too)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    # (bf16 compute, the gradients cast up and reduce-scattered in float32)
    bf16_fp32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for policy in (None, bf16, bf16_fp32) if model_name != "batchnorm" else (None,):
        model = _model(model_name)
        replay = _Replay(model, _sgd, comm.Get_size(), broadcast=False)
        options = {} if policy is None else {"mp_policy": policy}
        for unit in model.units():
            if any(p.requires_grad for p in unit.parameters()):
                fully_shard(unit, **options)
        fully_shard(model, **options)
        run = torch.compile(model) if compiled else model
        _train(comm, run, _sgd(model.parameters()), replay)
        # bf16: a few roundings (u = 2**-8) of every gradient, carried by 9.05 * LR
        tolerance = FLOAT32_TRAINING if policy is None else {"rtol": 0, "atol": 0.05}
        replay.check(comm, model, tolerance, f"FSDP2 {model_name} {policy}")


class _Mlp(torch.nn.Sequential):
    """Two layers whose hidden width decides how their dim-0 shards split across ranks."""

    def __init__(self, hidden: int):
        super().__init__(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))

    def units(self) -> list[torch.nn.Module]:
        return [self[0], self[2]]


class _TwiceInner(torch.nn.Module):
    """A unit that runs twice in one forward (its gradient reduced once, both uses summed)."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.outer(self.inner(x) + self.inner(x))

    def units(self) -> list[torch.nn.Module]:
        return [self.inner]


class _Unused(torch.nn.Module):
    """Two layers and one the forward never calls: a unit whose gradients stay None
    (PyTorch's autograd tests of FSDP2 with unused parameters), sharded with the rest."""

    def __init__(self):
        super().__init__()
        self.a, self.spare, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(8, 8), \
            torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

    def units(self) -> list[torch.nn.Module]:
        return [self.a, self.spare, self.b]


def _largest_dim(param: torch.nn.Parameter) -> Any:
    """FSDP2's shard placement on a parameter's largest dim."""
    from torch.distributed.tensor import Shard

    return Shard(param.shape.index(max(param.shape)))


#: The CPU cases of PyTorch's own FSDP2 training tests that exercise the group (uneven
#: shards and their padding in all-gather and reduce-scatter, sharding on another dim,
#: resharding after forward or not, CPU offload, the async unshard, a unit run twice,
#: explicit prefetching): case -> (model, whether each unit is sharded too, fully_shard's
#: options, what is set after sharding: "unshard-async", "prefetch" or None). Resharding
#: to a smaller group (an int) needs a world size with a divisor, which np 2 and 3 lack.
FSDP2_CASES = {
    "uneven-dim0-15": (lambda: _Mlp(15), False, {}, None),
    "uneven-dim0-7": (lambda: _Mlp(7), False, {}, None),
    "uneven-dim0-17": (lambda: _Mlp(17), False, {}, None),
    "largest-dim": (lambda: _Mlp(24), False, {"shard_placement_fn": _largest_dim}, None),
    "reshard-True": (_Block, True, {"reshard_after_forward": True}, None),
    "reshard-False": (_Block, True, {"reshard_after_forward": False}, None),
    "cpu-offload": (_Block, True, {"offload_policy": "cpu"}, None),
    "unshard-async": (_Block, True, {}, "unshard-async"),
    "unit-twice-True": (_TwiceInner, True, {"reshard_after_forward": True}, None),
    "unit-twice-False": (_TwiceInner, True, {"reshard_after_forward": False}, None),
    "prefetch": (_Block, True, {}, "prefetch"),
    "unused-parameter": (_Unused, True, {}, None),
}


@pytest.mark.parametrize("case", list(FSDP2_CASES))
def test_fsdp2_cases_of_pytorchs_cpu_suite(comm, case):
    """Each case trains against the float64 replay, replicas bit-identical: what PyTorch's
    TestFullyShard1DTrainingCore runs on the CPU (against DDP there) on our group."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    make, per_unit, options, after = FSDP2_CASES[case]
    torch.manual_seed(0)
    model = make()
    replay = _Replay(model, _sgd, comm.Get_size(), broadcast=False)
    if options.get("offload_policy") == "cpu":  # (made here: fsdp is imported lazily)
        options = dict(options, offload_policy=CPUOffloadPolicy(pin_memory=False))
    units = model.units() if per_unit else []
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)
    if after == "unshard-async":
        model._set_unshard_async_op(True)
    if after == "prefetch":
        for i, unit in enumerate(units[:-1]):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
            units[i + 1].set_modules_to_backward_prefetch([unit])
    _train(comm, model, _sgd(model.parameters()), replay)
    replay.check(comm, model, FLOAT32_TRAINING, f"FSDP2 {case}")


class _ClippedSGD(torch.optim.SGD):
    """SGD whose step first clips the gradients' total norm (torch.nn.utils.clip_grad_norm_,
    foreach) and keeps each step's norm: on FSDP2's sharded gradients the total norm is an
    all_reduce of the shards' norms over the group."""

    def __init__(self, params, norm_type: float):
        super().__init__(params, lr=LR, momentum=0.9)
        self.norm_type, self.norms = norm_type, []

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, self.norm_type, foreach=True)
        self.norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        return super().step(closure)


MAX_NORM = 0.05  # below every step's gradient norm here: each step clips


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_fsdp2_clips_the_total_gradient_norm(comm, norm_type):
    """clip_grad_norm_ over an FSDP2 model's sharded gradients: the total norm of every
    step is the replay's (a sum or a max of the shards' norms, reduced over our group)
    and the clipped training follows the replay. As PyTorch's FSDP2 clip_grad_norm_ tests
    check against DDP."""
    from torch.distributed.fsdp import fully_shard

    model = _model("transformer")
    replay = _Replay(model, lambda ps: _ClippedSGD(ps, norm_type), comm.Get_size(),
                     broadcast=False)
    for unit in model.units():
        fully_shard(unit)
    fully_shard(model)
    opt = _ClippedSGD(model.parameters(), norm_type)
    _train(comm, model, opt, replay)
    norms = torch.stack(opt.norms).double()
    expected = torch.stack(replay.opt.norms)
    assert (expected > MAX_NORM).all(), expected  # clipping is not vacuous
    torch.testing.assert_close(norms, expected, **FLOAT32_TRAINING)
    replay.check(comm, model, FLOAT32_TRAINING, f"FSDP2 clipped, norm {norm_type}")


def _frozen_weights(model: torch.nn.Module) -> torch.nn.Module:
    """model with its Linear layers' weights frozen (biases train: mixed requires_grad
    in one FSDP2 group, whose reduce-scatter then carries the biases' gradients only)."""
    for name, p in model.named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("case", ["frozen-weights", "accumulate-without-sync"])
def test_fsdp2_frozen_parameters_and_accumulation_without_sync(comm, case):
    """FSDP2 with frozen weights beside trainable biases in one group (PyTorch's
    test_fully_shard_frozen), and two micro-batches a step, the first with
    set_requires_gradient_sync(False) (the gradients reduce-scattered once, at the last:
    its gradient-accumulation tests), against the float64 replay."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Mlp(16)
    if case == "frozen-weights":
        _frozen_weights(model)
    replay = _Replay(model, _sgd, comm.Get_size(), broadcast=False)
    for unit in model.units():
        fully_shard(unit)
    fully_shard(model)

    class _NoSync:
        def __enter__(self):
            model.set_requires_gradient_sync(False)

        def __exit__(self, *exc):
            model.set_requires_gradient_sync(True)

    micro = 2 if case == "accumulate-without-sync" else 1
    _train(comm, model, _sgd([p for p in model.parameters() if p.requires_grad]), replay,
           micro_batches=micro, no_sync=_NoSync if micro > 1 else None)
    replay.check(comm, model, FLOAT32_TRAINING, f"FSDP2 {case}")


def test_fsdp2_full_state_dict_gathers_and_loads_from_rank_0(comm):
    """torch.distributed.checkpoint's full state dict of an FSDP2 model (every shard
    all-gathered over our group) is the replay's model on every rank; loaded back into a
    model sharded afresh with broadcast_from_rank0 (rank 0's full tensors broadcast, the
    other ranks passing nothing) it gives every rank its shards of those tensors."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    model = _model("transformer")
    replay = _Replay(model, _sgd, comm.Get_size(), broadcast=False)
    for unit in model.units():
        fully_shard(unit)
    fully_shard(model)
    _train(comm, model, _sgd(model.parameters()), replay)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    expected = replay.model.state_dict()
    assert set(full) == set(expected)
    for name, value in full.items():
        assert not hasattr(value, "full_tensor"), name  # a plain tensor, gathered
        torch.testing.assert_close(value.double(), expected[name], **FLOAT32_TRAINING)
        assert_same_on_all_ranks(comm, value.detach().float().clone().numpy(), name)

    torch.manual_seed(1)  # other values than the trained ones
    fresh = MODELS["transformer"]()
    for unit in fresh.units():
        fully_shard(unit)
    fully_shard(fresh)
    given = {k: v.clone() for k, v in full.items()} if comm.Get_rank() == 0 else {}
    set_model_state_dict(fresh, given, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    for name, value in fresh.state_dict().items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert torch.equal(value, full[name]), name


class _Chain(torch.nn.Sequential):
    """Three layers, each a unit; the last two also run without the first (the root's
    forward skipped: a forward through non-root units only)."""

    def __init__(self):
        super().__init__(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                         torch.nn.Tanh(), torch.nn.Linear(8, 3))

    def units(self) -> list[torch.nn.Module]:
        return [self[0], self[2], self[4]]


class _NonRoot(torch.nn.Module):
    """What calls _Chain's last two units alone (not a module FSDP knows: no root)."""

    def __init__(self, chain: _Chain):
        super().__init__()
        self.chain = [chain]  # (a list: not a submodule, the parameters stay the chain's)

    def forward(self, x):
        chain = self.chain[0]
        return chain[4](torch.tanh(chain[2](x)))


def test_fsdp2_forward_through_the_root_then_through_non_roots(comm):
    """Steps through the root FSDP2 module, then through non-root units only (PyTorch's
    test_non_root_forward_backward): a non-root's backward must reduce-scatter its
    gradients and wait for them without the root's end-of-backward callback."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Chain()
    replay = _Replay(model, _sgd, comm.Get_size(), broadcast=False)
    for unit in model.units():
        fully_shard(unit)
    fully_shard(model)
    opt = _sgd(model.parameters())
    _train(comm, model, opt, replay, steps=range(2))
    replay.forward = _NonRoot(replay.model)
    _train(comm, _NonRoot(model), opt, replay, steps=range(2, STEPS))
    replay.check(comm, model, FLOAT32_TRAINING, "FSDP2 root, then non-roots")


def test_fsdp2_reshards_to_a_smaller_group_after_forward(comm):
    """reshard_after_forward=2 (PyTorch's training tests run it beside True and False):
    after forward each unit keeps its parameters sharded over groups of 2 ranks (a group
    made of the job's, on our backend) and backward all-gathers within them. np 4 only:
    the world size must be a multiple of 2 larger than 2."""
    from torch.distributed.fsdp import fully_shard

    if comm.Get_size() != 4:
        pytest.skip("needs 4 ranks")
    model = _model("transformer")
    replay = _Replay(model, _sgd, comm.Get_size(), broadcast=False)
    for unit in model.units():
        fully_shard(unit, reshard_after_forward=2)
    fully_shard(model, reshard_after_forward=2)
    _train(comm, model, _sgd(model.parameters()), replay)
    replay.check(comm, model, FLOAT32_TRAINING, "FSDP2 reshard_after_forward=2")


# ------------------------------------------------------------------- our optimizers
def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("wrapper", ["DistributedOptimizer", "zero1", "zero2", "zero3",
                                     "OnebitAdam"])
def test_compiled_model_with_our_optimizers(comm, model_name, wrapper):
    """torch.compile(m) with our optimizers, which average the gradients from their hooks
    as the compiled backward produces them (OnebitAdam in its uncompressed warm-up, which
    is Adam on the averaged gradients)."""
    model = _model(model_name)
    replay = _Replay(model, _adam, comm.Get_size(), broadcast=False)
    if wrapper == "DistributedOptimizer":
        opt = DistributedOptimizer(_adam(model.parameters()),
                                   named_parameters=model.named_parameters())
    elif wrapper == "OnebitAdam":
        opt = OnebitAdam(model.parameters(), lr=0.01, freeze_step=100)
    elif wrapper == "zero3":
        opt = ZeroOptimizer(_adam(model.parameters()), stage=3, module=model,
                            units=model.units())
    else:
        opt = ZeroOptimizer(_adam(model.parameters()), stage=int(wrapper[-1]))
    _train(comm, torch.compile(model), opt, replay)
    with opt.gathered() if wrapper == "zero3" else nullcontext():  # stage 3: the whole model
        replay.check(comm, model, what=f"{wrapper} {model_name}")


# ------------------------------------------- what PyTorch's own compile-with-DDP tests run
class _Wide(torch.nn.Module):
    """Three 1 MiB layers, one of them under activation checkpointing: with 1 MiB
    buckets DDPOptimizer cuts the graph into several."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(3))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = torch.relu(self.layers[0](x))
        x = checkpoint(self.layers[1], x, use_reentrant=False)
        return self.layers[2](torch.cos(x))


def test_ddp_optimizer_splits_the_graph_at_our_buckets(comm):
    """The cases of torch's own compile-with-DDP tests that run on CPU and concern the
    group (test_graph_split, test_aot_autograd, test_custom_layer, test_higher_order_op,
    test_ignored_parameters): DDPOptimizer compiles one graph a bucket of DDP on our group,
    checkpointed layers included, a parameter DDP ignores keeps its own gradient, and
    forward and backward give eager DDP's results on every rank."""
    r, n = comm.Get_rank(), comm.Get_size()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm

    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = _Wide()
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["layers.0.bias"])
        ddp = DDP(model, bucket_cap_mb=1)  # (DDPOptimizer: not under its 1 MiB first)
        run = torch.compile(ddp, backend=counting) if compiled else ddp
        x = torch.randn(ROWS * n, 512, generator=torch.Generator().manual_seed(1))
        out = run(x[ROWS * r:ROWS * (r + 1)])
        out.square().mean().backward()
        results.append([out.detach()] + [p.grad.clone() for p in model.parameters()])
    assert len(graphs) > 1, len(graphs)
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, **FLOAT32_TRAINING)
    grads = dict(zip([name for name, _ in _Wide().named_parameters()], results[1][1:]))
    for name, grad in grads.items():
        if name != "layers.0.bias":
            assert_same_on_all_ranks(comm, grad.numpy(), name)
    ignored = comm.allgather(grads["layers.0.bias"].numpy())
    assert any((ignored[0] != other).any() for other in ignored[1:]), "an ignored gradient"
