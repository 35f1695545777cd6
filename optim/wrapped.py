"""WrappedOptimizer: a torch.optim.Optimizer whose param_groups, state and defaults are the
wrapped optimizer's (read and written through), so LR schedulers and GradScaler accept
it; and the argument checks the optimizers share."""


from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from collectives import api as C
from collectives.dtypes import FLOATING, NAMES, torch_dtype

#: The compressors a user may pass (Compression.none, .fp16, and any added later).
_COMPRESSORS = {name: c for name, c in vars(C.Compression).items() if not name.startswith("_")}
#: Parameter dtypes the collectives reduce: the floating ones.
_GRAD_DTYPES = tuple(torch_dtype(name) for name in FLOATING)
#: Tensor dtypes the collectives broadcast (bool travels as its uint8 view).
_BROADCAST_DTYPES = tuple(torch_dtype(name) for name in NAMES)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def _user_names(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> dict[int, str]:
    """id(tensor) -> name, or ValueError naming duplicate names or twice-named tensors."""
    try:
        pairs = [(name, p) for name, p in named_parameters]
    except (TypeError, ValueError):
        raise TypeError("named_parameters: expected an iterable of (name, tensor) pairs, "
                        "e.g. model.named_parameters()") from None
    duplicates = sorted(n for n, count in Counter(n for n, _ in pairs).items() if count > 1)
    if duplicates:
        raise ValueError(f"named_parameters: duplicate names {duplicates}")
    names: dict[int, str] = {}
    for name, p in pairs:
        if not isinstance(name, str) or not isinstance(p, torch.Tensor):
            raise TypeError(f"named_parameters: expected (str, tensor) pairs, got "
                            f"({type(name).__name__}, {type(p).__name__})")
        if id(p) in names:
            raise ValueError(f"named_parameters: {names[id(p)]!r} and {name!r} are the same tensor")
        names[id(p)] = name
    return names


class WrappedOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer that is a view of another (`.optimizer`): its param_groups,
    state and defaults are the wrapped one's objects, read and written through (the
    wrapped one's load_state_dict builds new ones), so LR schedulers, GradScaler,
    state_dict / load_state_dict and add_param_group act on the wrapped optimizer.
    Subclasses add what happens around its step()."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        if isinstance(optimizer, WrappedOptimizer):
            raise TypeError(f"optimizer: already a {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._wrapping = True  # Optimizer.__init__ lists the groups: they are there already
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._wrapping = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        if not self._wrapping:
            self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        if not self._wrapping:
            self.optimizer.state = value

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer (then _added(its index))."""
        if self._wrapping:
            return  # Optimizer.__init__ listing the wrapped optimizer's own groups
        self.optimizer.add_param_group(param_group)
        self._added(len(self.optimizer.param_groups) - 1)

    def _added(self, index: int) -> None:
        """A group was added at index."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


