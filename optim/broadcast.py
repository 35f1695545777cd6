"""broadcast_parameters and broadcast_optimizer_state: root_rank's parameters, and its
optimizer's state and hyper-parameters, on every rank (torch tensors by one grouped
call each; the rest of the state by broadcast_object)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from collectives import api as C

from .distributed import DistributedOptimizer
from .wrapped import _BROADCAST_DTYPES

# --------------------------------------------------------------------------- broadcasts

def _broadcastable(name: str, t: object) -> torch.Tensor:
    """t (bool as its uint8 view) ready for broadcast_, or TypeError naming it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.dtype not in _BROADCAST_DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} cannot be broadcast; expected bool or one "
                        f"of {[str(d) for d in _BROADCAST_DTYPES]}")
    return t


def _broadcast_all(named: list[tuple[str, Any]], root_rank: int, process_set: Any) -> None:
    """broadcast_ every tensor in place: all checked first, then launched together."""
    tensors = [_broadcastable(name, t) for name, t in named]
    handles = [C.broadcast_async_(t, root_rank=root_rank, process_set=process_set)
               for t in tensors]
    for handle in handles:
        C.synchronize(handle)


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0, process_set: C.ProcessSet | None = None) -> None:
    """Overwrite every rank's tensors, in place, with root_rank's (start from one init).

    params: a state_dict or (name, tensor) pairs such as model.named_parameters(); they
    travel sorted by name, so every rank must pass the same names."""
    items = sorted(params.items() if isinstance(params, Mapping) else params,
                   key=lambda item: item[0])
    _broadcast_all([(f"params[{name!r}]", t) for name, t in items], root_rank, process_set)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Marks where the index-th broadcast tensor goes back into a state_dict."""

    index: int


def _hollow(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """obj with each tensor of one or more dimensions moved to `tensors` (a _Slot left in
    its place); scalars such as Adam's step counter stay in obj."""
    if isinstance(obj, torch.Tensor) and obj.dim() > 0:
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _hollow(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_hollow(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of _hollow."""
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer | DistributedOptimizer,
                              root_rank: int = 0,
                              process_set: C.ProcessSet | None = None) -> None:
    """Give every rank root_rank's optimizer state and hyper-parameters (lr, betas, ...).

    State the optimizer creates lazily (Adam's moments before its first step) arrives by
    load_state_dict, not by a dummy step, so broadcasting never changes training: root's
    state is untouched and a rank whose root has no state yet keeps none."""
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch optimizer or DistributedOptimizer, "
                        f"got {type(optimizer).__name__}")
    is_root = C.rank() == root_rank
    tensors: list[torch.Tensor] = []
    payload = None
    if is_root:
        skeleton = _hollow(inner.state_dict(), tensors)
        payload = (skeleton, [(tuple(t.shape), t.dtype) for t in tensors])
    skeleton, specs = C.broadcast_object(payload, root_rank, process_set=process_set)
    if not is_root:
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    _broadcast_all([(f"optimizer state tensor {i}", t) for i, t in enumerate(tensors)], root_rank,
                   process_set)
    if not is_root:
        inner.load_state_dict(_fill(skeleton, tensors))
