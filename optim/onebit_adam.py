"""1-bit Adam (Tang et al., ICML 2021; DeepSpeed's OnebitAdam): Adam whose momentum, once
the variance has settled, travels as one bit per element with error feedback.

How it works. The optimizer does its own communication (use it instead of
DistributedOptimizer): call loss.backward() on each rank's share of the batch, then step().
  warm-up, steps 1..freeze_step: the gradients of every parameter are averaged in full
      precision and Adam runs as usual: every rank holds the same momentum m and variance
      v. With no weight decay this is torch.optim.Adam and with it torch.optim.AdamW
      (decoupled decay), step for step. The gradients travel in fused float32 buckets of
      up to BUCKET_BYTES, each started from the gradient hooks as soon as its
      gradients are complete, so the warm-up's full-size averages overlap backward too.
  compressed, after freeze_step: v is frozen. Each rank folds its own gradient into m,
      then m is averaged with collectives.compressed_allreduce (signs plus scales,
      with this rank's worker_error and server_error; both start at zero at the freeze),
      and the averaged m, the same on every rank, replaces it. The parameters' averages
      go in buckets of up to BUCKET_BYTES, one grouped_compressed_allreduce each: the
      bits of one call per parameter, for one call's fixed cost. The update is
      m / (sqrt(v) + eps), with the bias corrections, plus decoupled weight decay.
      Both first parts need only the parameter's gradient: they start from its gradient
      hook during backward (in one fixed order on every rank: _Launches), so the 1-bit
      averages travel while backward goes on; step() waits for them and updates each
      parameter in one pass (kernels.adam_update). With gradient accumulation, say how
      many backward passes make a step (backward_passes_per_step, as Horovod's).

Beyond DeepSpeed (measured in docs/onebit_adam.md):
  - bias_correction is applied (DeepSpeed accepts the flag and ignores it): with a short
    warm-up, the uncorrected v is a small fraction of the true variance, and freezing it
    would keep the step several times too large for the rest of training.
  - max_update bounds each coordinate of m / (sqrt(v) + eps) after the freeze, by default
    to the bound Adam's own steps obey (Kingma & Ba, section 2.1): max(1, (1 - beta1) /
    sqrt(1 - beta2)), 3.16 for the default betas. Adam keeps within it because v grows
    with every gradient; a frozen v cannot, so a coordinate whose variance was ~0 at the
    freeze (always-blank input pixels, dead units) but which later sees a gradient, or
    only the +-scale of a sign, takes steps of m / eps and blows the model up. DeepSpeed
    asks the user for a mask of such coordinates (exp_avg_mask); the bound needs none.
  - block_size gives one scale per block of that many elements instead of one per tensor,
    so coordinates of different magnitudes in one tensor no longer share a scale.
OnebitAdam(..., block_size=None, bias_correction=False, max_update=math.inf) is DeepSpeed's
algorithm (without its first step, which only warms up its communication backend and
discards that step's gradient).

Cost per step, n ranks, P parameters: warm-up, float32 allreduces of P elements in all
(2(n-1)/n 4P bytes per rank on a ring), in ceil(4P / BUCKET_BYTES) or more calls;
compressed, the same number of grouped 1-bit calls: about 2(n-1)/n (P/8 + 4P/block_size)
bytes, 1/28 of the warm-up's with block_size=256, in 3 latency rounds per call.

State (state_dict): per parameter exp_avg, exp_avg_sq, step and, after the freeze, this
rank's worker_error and server_error. The error buffers belong to one rank of one world
size: load_state_dict keeps them only if the state was saved by this rank in a world of
this size, and otherwise resets them to zeros (what DeepSpeed always does). Save every
rank's state_dict to resume bit for bit.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from collectives import api as C
from collectives import kernels
from collectives.algorithms.onebit import error_sizes
from collectives.api.compressed import compressed_allreduce_async, grouped_compressed_allreduce_async

from .overlap import bucketed, count_pass

_ERRORS = ("worker_error", "server_error")

#: A launch unit (the warm-up's fused gradients, or after the freeze the momenta of one
#: grouped 1-bit call) holds at most this many bytes; a larger parameter has one to itself.
#: A smaller unit starts its average earlier in backward, for one more call's latency,
#: agreement and fixed CPU, which a bias's 1-bit call pays as much as a layer's
#: (benchmarks/results/slow-link.md): 8 MiB is 0.7 ms at 100 Gbit/s.
BUCKET_BYTES = 8 << 20


def _check_number(name: str, value: object, low: float, high: float = math.inf,
                  low_open: bool = False) -> float:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and (low < value if low_open else low <= value) and value < high)
    if not ok:
        bounds = f"{'(' if low_open else '['}{low}, {high})"
        raise ValueError(f"{name}: expected a number in {bounds}, got {value!r}")
    return float(value)


def _check_options(lr: object, betas: object, eps: object, weight_decay: object,
                   freeze_step: object, block_size: object, max_update: object) -> None:
    _check_number("lr", lr, 0.0)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas: expected a pair (beta1, beta2), got {betas!r}")
    for name, beta in zip(("betas[0]", "betas[1]"), betas):
        _check_number(name, beta, 0.0, 1.0)
    _check_number("eps", eps, 0.0)
    _check_number("weight_decay", weight_decay, 0.0)
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
        raise ValueError(f"freeze_step: expected an int >= 1 (the variance is learned "
                         f"before it is frozen), got {freeze_step!r}")
    if block_size is not None and (isinstance(block_size, bool)
                                   or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size: expected None or an int >= 1, got {block_size!r}")
    if max_update is not None and (isinstance(max_update, bool)
                                   or not isinstance(max_update, (int, float))
                                   or not max_update > 0):
        raise ValueError(f"max_update: expected None (Adam's bound), a number > 0 or "
                         f"math.inf (unbounded), got {max_update!r}")


class OnebitAdam(torch.optim.Optimizer):
    """1-bit Adam over all ranks (see the module docstring for the algorithm).

    Every rank constructs it over the same float32 parameters, in the same order, and
    steps together. A parameter without a gradient on a rank counts as a zero gradient
    there, so every rank communicates the same tensors."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int = 100000,
                 block_size: int | None = 256, bias_correction: bool = True,
                 max_update: float | None = None, backward_passes_per_step: int = 1):
        _check_options(lr, betas, eps, weight_decay, freeze_step, block_size, max_update)
        if isinstance(backward_passes_per_step, bool) or \
                not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step: expected an int >= 1, got "
                             f"{backward_passes_per_step!r}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self._launches = _Launches(backward_passes_per_step)
        weakref.finalize(self, self._launches.remove_hooks)
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.block_size = block_size
        self.bias_correction = bool(bias_correction)
        self.max_update = max_update

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        dtypes = {p.dtype for p in group["params"]} - {torch.float32}
        if dtypes:
            self.param_groups.pop()
            raise TypeError(f"params: OnebitAdam needs float32 parameters (keep float32 "
                            f"master weights for mixed precision), got {sorted(map(str, dtypes))}")
        owner = weakref.ref(self)
        for p in group["params"]:
            self._launches.add(p, group, owner)

    # ------------------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average the gradients (full precision, or the momentum compressed after
        freeze_step) and update every parameter; the same on every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        launched = self._launches.rest(self._plan, self._launch)
        for group in self.param_groups:
            for p in group["params"]:
                self._state(p)["step"] += 1
        for unit, handle, flat in launched:
            if handle is not None:
                C.synchronize(handle)
            if flat is not None:
                self._warm_step(unit, flat)
            else:
                for item in unit:
                    self._update(*item)
        return loss

    def _compressed(self, p: torch.Tensor) -> bool:
        """Whether p's coming step is after the freeze."""
        state = self.state.get(p)
        return bool(state) and state["step"] + 1 > self.freeze_step

    def _plan(self, order: list[_Item]) -> list[list[_Item]]:
        """This step's launch units, in order: each run of consecutive parameters before the
        freeze, and each run after it, in DistributedOptimizer's buckets (bucketed: one
        dtype and device each, up to BUCKET_BYTES); after the freeze a device parameter is
        a unit alone (its 1-bit average runs on its device). It depends only on the order
        and the steps taken, so every rank makes the same units."""
        units: list[list[_Item]] = []
        for frozen, run in itertools.groupby(order, key=lambda item: self._compressed(item[1])):
            run = list(run)
            group_of = {id(p): group for group, p in run}
            for bucket in bucketed([p for _, p in run], BUCKET_BYTES):
                items = [(group_of[id(p)], p) for p in bucket]
                if frozen and bucket[0].device.type != "cpu":
                    units += [[item] for item in items]
                else:
                    units.append(items)
        return units

    @torch.no_grad()
    def _launch(self, unit: list[_Item]) -> tuple[C.Handle | None, torch.Tensor | None]:
        """Start a unit's communication, which needs only its gradients: (the call or None,
        the warm-up's fused buffer or None). Run from the gradient hooks during backward,
        in _Launches' fixed order, or from step() for those still due.
          warm-up bucket: the gradients packed and averaged (float32, in place);
          after the freeze: each gradient folded into its m, and the 1-bit averages of the
          unit's m started in one call, written over them."""
        if not self._compressed(unit[0][1]):
            flat = kernels.pack([_grad(q) for _, q in unit])
            alone = C.size() == 1  # alone, a gradient is already the average
            return (None if alone else C.allreduce_async_(flat, op=C.Average)), flat
        for group, p in unit:
            self.state[p]["exp_avg"].lerp_(_grad(p), 1 - group["betas"][0])
        if C.size() == 1:
            return None, None
        momenta = [self.state[p]["exp_avg"] for _, p in unit]
        workers, servers = zip(*(self._errors(p, self.state[p]) for _, p in unit))
        if len(unit) == 1:  # on a device too
            return compressed_allreduce_async(momenta[0], workers[0], servers[0],
                                              self.block_size, out=momenta[0]), None
        return grouped_compressed_allreduce_async(momenta, list(workers), list(servers),
                                                  self.block_size, outs=momenta), None

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _warm_step(self, items: list[_Item], flat: torch.Tensor) -> None:
        """Adam on a warm-up bucket's gradients, averaged in flat."""
        offset = 0
        for group, p in items:
            grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            state = self.state[p]
            beta1, beta2 = group["betas"]
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            self._apply(group, p, state)

    def _update(self, group: dict[str, Any], p: torch.Tensor) -> None:
        """After the freeze, with m averaged: frozen variance, each coordinate's step
        bounded; in one pass over p, m and v on the host (kernels.adam_update), with
        torch's operations on a device."""
        state = self.state[p]
        lr, eps, bound = group["lr"], group["eps"], self._bound(group)
        correction1, correction2 = self._corrections(group, state)
        decay = 1 - lr * group["weight_decay"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if p.device.type == "cpu":
            kernels.adam_update(p.detach(), m, v, lr=lr, c1=correction1,
                                sqrt_c2=correction2 ** 0.5, eps=eps, decay=decay, bound=bound)
            return
        p.mul_(decay)
        denom = (v.sqrt() / correction2 ** 0.5).add_(eps)
        p.add_((m / correction1).div_(denom).clamp_(-bound, bound), alpha=-lr)

    def _errors(self, p: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """This rank's error buffers for p: zeros at the freeze, after a reset, or when the
        job's size changed (collectives.elastic shrank it: the chunks are not the same)."""
        sizes = error_sizes(p.numel(), C.size())
        if "worker_error" not in state or \
                (state["worker_error"].numel(), state["server_error"].numel()) != sizes:
            for name, size in zip(_ERRORS, sizes):
                state[name] = torch.zeros(size, dtype=torch.float32, device=p.device)
        return state["worker_error"], state["server_error"]

    def _bound(self, group: dict[str, Any]) -> float:
        """max_update, or by default Adam's own bound on |m_hat / sqrt(v_hat)|."""
        if self.max_update is not None:
            return self.max_update
        beta1, beta2 = group["betas"]
        return max(1.0, (1 - beta1) / math.sqrt(1 - beta2))

    def _corrections(self, group: dict[str, Any], state: dict[str, Any]) -> tuple[float, float]:
        """Adam's bias corrections (1, 1 without bias_correction); v's stops at the freeze,
        with v."""
        if not self.bias_correction:
            return 1.0, 1.0
        beta1, beta2 = group["betas"]
        step = state["step"]
        return 1 - beta1 ** step, 1 - beta2 ** min(step, self.freeze_step)

    def _apply(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        """The warm-up's update: p -= lr * (m_hat / (sqrt(v_hat) + eps)) after decoupled
        weight decay, rounded as torch.optim.Adam(W) rounds it."""
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        correction1, correction2 = self._corrections(group, state)
        if weight_decay:
            p.mul_(1 - lr * weight_decay)
        denom = (state["exp_avg_sq"].sqrt() / correction2 ** 0.5).add_(eps)
        p.addcdiv_(state["exp_avg"], denom, value=-lr / correction1)

    # ------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus the rank and world size the error buffers belong to."""
        state = super().state_dict()
        state["error_feedback"] = {"rank": C.rank(), "size": C.size()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict; error buffers saved by another rank, or in a world of
        another size, are dropped (zeros at the next compressed step)."""
        state_dict = dict(state_dict)
        owner = state_dict.pop("error_feedback", None)
        self._launches.forget()  # a step cut short (a failure elastic.run recovers from)
        super().load_state_dict(state_dict)
        if owner != {"rank": C.rank(), "size": C.size()}:
            for state in self.state.values():
                for name in _ERRORS:
                    state.pop(name, None)


def _grad(p: torch.Tensor) -> torch.Tensor:
    """p's gradient, zeros if it has none on this rank (all ranks send every tensor)."""
    if p.grad is None:
        return torch.zeros_like(p)
    if p.grad.is_sparse:
        raise RuntimeError("OnebitAdam does not support sparse gradients")
    return p.grad


_Item = tuple[dict[str, Any], torch.Tensor]  # (param group, parameter)
#: what a launched unit left for step(): the unit, its call (None: nothing sent), the
#: warm-up's fused gradients (None after the freeze)
_Launched = tuple[list[_Item], "C.Handle | None", "torch.Tensor | None"]


class _Launches:
    """When each unit of a step (OnebitAdam._plan: a warm-up bucket, or one parameter after
    the freeze) starts its communication (OnebitAdam._launch): as soon as its gradients are
    complete in backward, so that it travels while backward goes on. Units launch in one
    fixed order on every rank (parameters in the reverse of the optimizer's order,
    backward's usual one), a unit ready early waiting for those before it, so every rank
    starts the same collectives in the same order whatever order its hooks fire in;
    step() launches the rest, in that order."""

    def __init__(self, passes: int) -> None:
        self.passes = passes  # backward passes that make a gradient complete
        self.order: list[_Item] = []
        self.counts: dict[int, int] = {}  # backward passes seen this step, by parameter id
        self.units: list[list[_Item]] | None = None  # this step's plan, once made
        self.launched: list[_Launched] = []  # this step's, in order
        self.lock = threading.Lock()
        self.hooks: list = []  # the gradient hooks' handles, removed with the optimizer

    def add(self, p: torch.Tensor, group: dict[str, Any], owner: weakref.ref) -> None:
        """Take p into the order, with a hook that reports its gradient to owner."""
        self.order.insert(0, (group, p))
        if p.requires_grad:
            self.hooks.append(p.register_post_accumulate_grad_hook(_hook(owner)))

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def grad_ready(self, p: torch.Tensor, plan: Callable, launch: Callable) -> None:
        """Hook: p's gradient is complete; launch every unit now due, in order (the step's
        plan made from `plan` at its first gradient)."""
        with self.lock:
            count_pass(self.counts, p, self.passes,
                       f"OnebitAdam's parameter of shape {tuple(p.shape)}", "step()")
            if self.units is None:
                self.units = plan(self.order)
            while len(self.launched) < len(self.units) and all(
                    self.counts.get(id(q), 0) == self.passes
                    for _, q in self.units[len(self.launched)]):
                self._one(launch)

    def rest(self, plan: Callable, launch: Callable) -> list[_Launched]:
        """Launch what is still due, in order; this step's launched units. The next step
        starts afresh."""
        with self.lock:
            if self.units is None:
                self.units = plan(self.order)
            while len(self.launched) < len(self.units):
                self._one(launch)
            launched = self.launched
            self.units, self.launched, self.counts = None, [], {}
        return launched

    def forget(self) -> None:
        """Drop this step's launches (their calls are finished, or failed with the job)."""
        with self.lock:
            self.units, self.launched, self.counts = None, [], {}

    def _one(self, launch: Callable) -> None:
        unit = self.units[len(self.launched)]
        self.launched.append((unit, *launch(unit)))


def _hook(owner: weakref.ref) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook reporting to the optimizer while it is alive."""
    def hook(param: torch.Tensor) -> None:
        opt = owner()
        if opt is not None and C.size() > 1:
            opt._launches.grad_ready(param, opt._plan, opt._launch)
    return hook

