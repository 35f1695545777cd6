"""State dicts as trees: dicts, lists and tuples whose leaves are tensors, arrays and plain
values, walked alike by the buddy copies (elastic/buddies.py) and the snapshot files
(elastic/snapshot.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """obj with each leaf (whatever is not a dict, list or tuple) replaced by fn(leaf), the
    containers rebuilt as they were."""
    if isinstance(obj, dict):
        return {k: map_leaves(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_leaves(v, fn) for v in obj)
    return fn(obj)
