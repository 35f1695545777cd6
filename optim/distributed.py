"""Data-parallel training on top of collectives: DistributedOptimizer averages gradients
over all ranks while backward runs.

How gradients move. At construction the parameters are split, in reverse registration
order (the order backward produces their gradients), into buckets of at most
`fusion_threshold_bytes`, one dtype and device each. A hook on each parameter marks its
gradient ready; a bucket whose gradients are all ready is packed into one flat buffer and
its allreduce launched asynchronously, while backward goes on. Buckets launch in their
fixed order on every rank (a bucket ready early waits for the ones before it), so the
collectives are issued identically everywhere whatever order the hooks fire in. `step()`
launches what is left, waits, unpacks the averages into `.grad` and steps the optimizer.

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
    broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast_optimizer_state(opt, root_rank=0)
    loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from collectives import api as C
from collectives import kernels as _kernels
from collectives.compression.topk import TopKCompressor
from collectives.runtime.p2p import even_bounds

from .overlap import Overlapped, bucketed
from .wrapped import _COMPRESSORS, _GRAD_DTYPES, _check_int, _user_names

# ------------------------------------------------------------------------------ fusion

@dataclasses.dataclass(frozen=True)
class _Reduction:
    """How every bucket is reduced: scaled by `prescale` while packing, reduced with `op`,
    scaled by `postscale` while unpacking (gradient_predivide_factor splits the average)."""

    op: C.ReduceOp
    algorithm: str
    compression: Any
    prescale: float = 1.0
    postscale: float = 1.0
    process_set: Any = None
    sparse_as_dense: bool = False
    #: postscale is divided by the set's size when the bucket is unpacked (a Sum over the
    #: set as it is then: joined ranks add zeros, and a job shrunk by collectives.elastic
    #: divides by its new size)
    divide_by_size: bool = False

    def post(self) -> float:
        """The factor the reduced gradients are scaled by now."""
        return self.postscale / _set_size(self.process_set) if self.divide_by_size \
            else self.postscale


class _Bucket:
    """Gradients of one dtype and device reduced together through one flat buffer."""

    __slots__ = ("params", "buffer", "ready", "grads", "handle", "sparse", "compressor")

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        # the reduction's compressor, or this bucket's own where it carries a residual
        # (Top-K: what one step did not send, the next sends)
        self.compressor: Any = None
        numel = sum(p.numel() for p in params)
        self.buffer = torch.empty(numel, dtype=params[0].dtype, device=params[0].device)
        self.ready = 0  # parameters whose gradient is complete for this step
        self.grads: list[torch.Tensor] = []  # the .grad tensors packed at launch
        self.handle: C.Handle | None = None
        # (param, indices handle, values handle) of this step's sparse gradients; the
        # handles are None for those reduced dense (sparse_as_dense)
        self.sparse: list[tuple] = []

    def launch(self, how: _Reduction) -> None:
        """Pack the gradients and start their allreduce. A parameter that got no gradient
        this step contributes zeros (and receives the reduced gradient as its .grad)."""
        dense = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if not p.grad.is_sparse:
                dense.append(p.grad)
            elif how.sparse_as_dense:  # reduced dense, handed back sparse (finish)
                self.sparse.append((p, None, None))
                p.grad = p.grad.to_dense()
                dense.append(p.grad)
            else:  # Horovod's sparse allreduce: every rank's entries, gathered
                grad = p.grad.coalesce()
                self.sparse.append((p, *(C.allgather_async(t, process_set=how.process_set)
                                         for t in (grad.indices().t().contiguous(),
                                                   grad.values() * how.prescale))))
        self.grads = dense
        _kernels.pack(dense, self.buffer, how.prescale)  # a prefix when some are sparse
        self.handle = C.allreduce_async_(self.buffer, op=how.op, algorithm=how.algorithm,
                                         compression=self.compressor or how.compression,
                                         process_set=how.process_set)

    def finish(self, how: _Reduction) -> None:
        """Wait for the reductions and write the reduced gradients back into .grad (a
        sparse gradient stays sparse: the sum of every rank's entries, coalesced)."""
        C.synchronize(self.handle)
        _kernels.unpack(self.buffer, self.grads, how.post())
        for p, indices, values in self.sparse:
            if indices is None:  # sparse_as_dense
                p.grad = p.grad.to_sparse()
                continue
            scale = how.post() / (_set_size(how.process_set) if how.op is C.Average else 1)
            p.grad = torch.sparse_coo_tensor(C.synchronize(indices).t(),
                                             C.synchronize(values) * scale, p.grad.shape,
                                             check_invariants=False).coalesce()  # valid:
            # every rank's indices of a coalesced gradient of this shape
        self.drop()

    def drop(self) -> None:
        """Forget this step's gradients and reductions (done, or abandoned)."""
        self.grads, self.sparse, self.handle, self.ready = [], [], None, 0


def _set_size(process_set: Any) -> int:
    return C.size() if process_set is None else process_set.size()


def _make_buckets(params: list[torch.Tensor], threshold: int,
                  groups: list[list[torch.Tensor]] | None = None,
                  num_groups: int = 0) -> list[_Bucket]:
    """params (in backward order) grouped into buckets of one dtype and device, in the
    order their first gradient arrives: with num_groups, that many runs of about equal
    length (Horovod's num_groups); the parameters of each of `groups` together; the others
    in buckets of at most `threshold` bytes (a larger parameter gets a bucket of its own)."""
    if num_groups:
        bounds = even_bounds(len(params), num_groups)
        runs = [params[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
        return [_Bucket(b) for run in runs for b in _by_kind(run) if b]
    member = {id(p): k for k, group in enumerate(groups or []) for p in group}
    chosen: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if id(p) in member:
            chosen.setdefault(member[id(p)], []).append(p)
    buckets = [b for k in chosen for b in _by_kind(chosen[k])]
    buckets += bucketed([p for p in params if id(p) not in member], threshold)
    return [_Bucket(b) for b in buckets]


def _by_kind(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """params split by (dtype, device), each part in the given order."""
    parts: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        parts.setdefault((p.dtype, p.device), []).append(p)
    return list(parts.values())


def _check_groups(groups: Any, optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """groups as lists of the optimizer's parameters, each in at most one group."""
    if groups is None:
        return []
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    seen: set[int] = set()
    out = []
    try:
        for k, group in enumerate(groups):
            group = list(group)
            for p in group:
                if not isinstance(p, torch.Tensor) or id(p) not in mine:
                    raise ValueError(f"groups[{k}]: expected the optimizer's parameters, got "
                                     f"{type(p).__name__} not among them")
                if id(p) in seen:
                    raise ValueError(f"groups[{k}]: a parameter is in more than one group")
                seen.add(id(p))
            out.append(group)
    except TypeError:
        raise TypeError("groups: expected a list of lists of parameters") from None
    return out


# --------------------------------------------------------------------- argument checks

def _check_reduction(op: object, factor: object, algorithm: object, compression: object,
                     process_set: Any, initial_size: object) -> _Reduction:
    if op is not C.Average and op is not C.Sum:
        raise ValueError(f"op: expected collectives.Average or collectives.Sum, got {op!r}")
    if (isinstance(factor, bool) or not isinstance(factor, (int, float))
            or not math.isfinite(factor) or factor <= 0):
        raise ValueError(f"gradient_predivide_factor: expected a finite number > 0, got {factor!r}")
    if factor != 1 and op is not C.Average:
        raise ValueError(f"gradient_predivide_factor: only valid with op=Average, got {factor!r} "
                         f"with op={op!r}")
    if algorithm not in C.ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {list(C.ALGORITHMS)}, got {algorithm!r}")
    if not any(compression is c for c in _COMPRESSORS.values()) \
            and not isinstance(compression, TopKCompressor):
        names = [f"Compression.{n}" for n in _COMPRESSORS if n != "topk"]
        raise ValueError(f"compression: expected one of {names} or Compression.topk(ratio), "
                         f"got {compression!r}")
    if process_set is not None and not isinstance(process_set, C.ProcessSet):
        raise TypeError(f"process_set: expected a collectives.ProcessSet, got "
                        f"{type(process_set).__name__}")
    if not isinstance(initial_size, bool):
        raise TypeError(f"divide_by_initial_world_size: expected a bool, got "
                        f"{type(initial_size).__name__}")
    if op is C.Sum:
        return _Reduction(op, algorithm, compression, process_set=process_set)
    # x / f averaged, then * f: the average, with smaller partial sums; over the whole set
    # (torch Join's initial world size), a Sum (joined ranks add zeros) then * f / its size
    if not initial_size:
        return _Reduction(C.Average, algorithm, compression, 1.0 / factor, factor, process_set)
    return _Reduction(C.Sum, algorithm, compression, 1.0 / factor, factor, process_set,
                      divide_by_size=True)


# ---------------------------------------------------------------------------- optimizer

class DistributedOptimizer(Overlapped):
    """Wraps a torch optimizer so each step uses gradients reduced over all ranks (averaged
    by default). It is a torch.optim.Optimizer sharing the wrapped one's param_groups,
    state and defaults (the same objects), so LR schedulers, GradScaler, state_dict /
    load_state_dict, zero_grad and add_param_group work on it as on the wrapped one, which
    is `.optimizer`.

    backward_passes_per_step=k: gradients add up locally over k backward passes and are
    reduced once, during the k-th. For gradient clipping, reduce first:
    `opt.synchronize(); clip(...); with opt.skip_synchronize(): opt.step()`.

    A parameter that got no gradient on a rank (unused in its forward) counts as zeros
    there, and every rank's .grad receives the reduced gradient, so all ranks step alike
    (as in Horovod; a parameter unused on every rank gets zeros where a single process
    would leave .grad None). Parameters with requires_grad=False at construction, of any
    dtype, are never reduced. Every rank must construct it over the same parameters and
    call add_param_group alike.

    Horovod's arguments: groups (lists of parameters, each reduced as one fused message;
    the rest by fusion_threshold_bytes) or num_groups (that many equal groups of the
    parameters), sparse_as_dense (sparse gradients, e.g. nn.Embedding(sparse=True)'s, are
    made dense and reduced with the rest; otherwise every rank's indices and values are
    allgathered and summed into a sparse gradient, as Horovod does), process_set (reduce
    over that set's ranks; on a rank outside the set it is the wrapped optimizer as it
    is, as in Horovod).

    While some ranks have joined (collectives.join), Average is over the ranks still
    active; divide_by_initial_world_size=True (torch Join's argument of that name) makes it
    over every rank of the set, the joined ones adding zeros, as Horovod's optimizer and
    DDP under Join by default do.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: Any = C.Compression.none, backward_passes_per_step: int = 1,
                 op: C.ReduceOp = C.Average, gradient_predivide_factor: float = 1.0,
                 fusion_threshold_bytes: int = 64 << 20, algorithm: str = "auto",
                 process_set: C.ProcessSet | None = None, num_groups: int = 0,
                 groups: Iterable[Iterable[torch.Tensor]] | None = None,
                 sparse_as_dense: bool = False, divide_by_initial_world_size: bool = False):
        super().__init__(optimizer, backward_passes_per_step)
        self._num_groups = _check_int("num_groups", num_groups, 0)
        self._groups = _check_groups(groups, optimizer)
        if self._groups and self._num_groups:
            raise ValueError("groups, num_groups: pass one or the other")
        if not isinstance(sparse_as_dense, bool):
            raise TypeError(f"sparse_as_dense: expected a bool, got {type(sparse_as_dense).__name__}")
        self._threshold = _check_int("fusion_threshold_bytes", fusion_threshold_bytes, 0)
        self._how = dataclasses.replace(
            _check_reduction(op, gradient_predivide_factor, algorithm, compression, process_set,
                             divide_by_initial_world_size),
            sparse_as_dense=sparse_as_dense)
        if isinstance(compression, TopKCompressor) and compression.momentum and any(
                g.get("momentum", 0) for g in optimizer.param_groups):
            raise ValueError(f"compression: Compression.topk(momentum={compression.momentum}) "
                             f"corrects the momentum itself (DGC), and the wrapped "
                             f"{type(optimizer).__name__} has momentum too: wrap one with "
                             f"momentum=0")
        # a rank outside process_set reduces nothing: it steps on its own gradients
        self._member = process_set is None or process_set.included()
        self._user_names = None if named_parameters is None else _user_names(named_parameters)
        self._names: dict[int, str] = {}  # id(param) -> name, for error messages
        self._synchronized_by_user = False  # synchronize() called since the last step()
        for index in range(len(optimizer.param_groups)):
            self._add_group(index)

    # ---- the wrapped optimizer's face (WrappedOptimizer), with buckets for added groups
    def _added(self, index: int) -> None:
        self._add_group(index)

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Each reduced parameter's name (Horovod's attribute of the same name): from
        named_parameters, else its place, `param_groups[i][j]`, the same on every rank."""
        return {p: self._names[id(p)] for group in self.param_groups for p in group["params"]
                if id(p) in self._names}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients and any partly accumulated backward passes."""
        self._check_idle("zero_grad()")
        self._reset_counts()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # ---- reduction
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce the gradients (unless inside skip_synchronize()) and step the optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._skip:
            if self._synchronized_by_user:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(): if the gradients changed since "
                              "(e.g. clipped), wrap step() in `with "
                              "optimizer.skip_synchronize():`", stacklevel=2)
            self._synchronize()
        elif self._next or self._counts:
            raise RuntimeError("step() inside skip_synchronize() with gradients not yet "
                               "reduced: call synchronize() before the with block")
        self.optimizer.step()
        self._synchronized = self._synchronized_by_user = False
        return loss

    def synchronize(self) -> None:
        """Finish reducing this step's gradients into .grad; a no-op if already done.

        Buckets still waiting are launched, in order, with zeros for parameters that got
        no gradient (unused in forward): every rank reduces every bucket every step."""
        self._synchronize()
        self._synchronized_by_user = True

    # ---- internals
    def _add_group(self, index: int) -> None:
        """Name the group's parameters, bucket them and hook them."""
        if not self._member:
            return
        trainable = []
        for i, p in enumerate(self.optimizer.param_groups[index]["params"]):
            if p.requires_grad:
                self._names[id(p)] = self._name(p, f"param_groups[{index}][{i}]")
                trainable.append(p)
        buckets = _make_buckets(list(reversed(trainable)), self._threshold, self._groups,
                                self._num_groups)
        if isinstance(self._how.compression, TopKCompressor):
            for bucket in buckets:
                bucket.compressor = self._how.compression.fresh()
        self._watch(buckets)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict; under Top-K compression, also every bucket's
        residual, with the rank and world size it belongs to."""
        state = super().state_dict()
        if isinstance(self._how.compression, TopKCompressor):
            state["topk_residuals"] = {"rank": C.rank(), "size": C.size(), "buckets": [
                b.compressor.state_dict() for b in self._buckets]}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict; Top-K residuals saved by another rank, in a world of another
        size or over other buckets are dropped (the buckets start from zeros)."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("topk_residuals", None)
        super().load_state_dict(state_dict)
        if not isinstance(self._how.compression, TopKCompressor):
            return
        mine = saved is not None and (saved["rank"], saved["size"]) == (C.rank(), C.size()) \
            and len(saved["buckets"]) == len(self._buckets)
        for k, bucket in enumerate(self._buckets):
            bucket.compressor = self._how.compression.fresh()
            if mine:
                bucket.compressor.load_state_dict(saved["buckets"][k])

    def _name(self, p: torch.Tensor, position: str) -> str:
        if p.dtype not in _GRAD_DTYPES:
            raise TypeError(f"parameter {position}: dtype {p.dtype} is not supported; expected "
                            f"one of {[str(d) for d in _GRAD_DTYPES]}")
        if self._user_names is None:
            return position
        if id(p) not in self._user_names:
            raise ValueError(f"named_parameters: the optimizer's parameter {position} (shape "
                             f"{tuple(p.shape)}) is missing; name every parameter it updates")
        return self._user_names[id(p)]

    def _label(self, param: torch.Tensor) -> str:
        return repr(self._names[id(param)])

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launch(self._how)

    def _finish(self, bucket: _Bucket) -> None:
        bucket.finish(self._how)
