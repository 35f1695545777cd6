"""ZeroOptimizer's checkpoint format (optim/zero.py): a shard is one rank's state_dict(),
its wrapped optimizer's state over this rank's pieces and each piece's place (parameter,
offset, length). Shards saved at any world size become whole per-parameter values here
(full_states), which a layout of any size slices (slice_of); part_of cuts from a shard
only what another layout's rank needs, so resharding need not move every shard to every
rank."""

from __future__ import annotations

from typing import Any

import torch

#: The format tag of a shard returned by state_dict().
SHARD_FORMAT = "collectives.zero/1"


def part_of(shard: dict[str, Any], placement: list[list[tuple[int, int, int]]]
            ) -> dict[str, Any]:
    """The part of a shard (state_dict() of one rank) over the pieces of another layout
    (ZeroOptimizer.placement of the rank that will load it), itself a shard of the same
    format (its tensors views of shard's): what that rank needs of it, among the shards of
    every old rank, to load. Without the parameters' pieces and 1-bit error buffers (these
    restart at zeros when resharded)."""
    state = shard["optimizer"]["state"]
    parts: list[list[tuple[int, int, int]]] = []
    values: dict[int, dict[str, Any]] = {}
    index = 0
    for old, new in zip(shard["placement"], placement):
        wanted: dict[int, list[tuple[int, int]]] = {}
        for i, offset, length in new:
            wanted.setdefault(i, []).append((offset, offset + length))
        mine: list[tuple[int, int, int]] = []
        for i, offset, length in old:
            entry = state.get(index, {})
            index += 1
            for lo, hi in wanted.get(i, ()):
                a, b = max(lo, offset), min(hi, offset + length)
                if a >= b:
                    continue
                values[sum(len(g) for g in parts) + len(mine)] = {
                    key: v[a - offset:b - offset]
                    if isinstance(v, torch.Tensor) and v.dim() >= 1 else v
                    for key, v in entry.items()}
                mine.append((i, a, b - a))
        parts.append(mine)
    return {"format": SHARD_FORMAT, "world_size": shard["world_size"],
            "numels": shard["numels"], "placement": parts, "errors": [],
            "optimizer": {"state": values,
                          "param_groups": shard["optimizer"]["param_groups"]}}


def is_sliced(value: Any, numel: int) -> bool:
    """Whether a state value is per element of its parameter (momentum, moments), not a
    scalar (Adam's step)."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.numel() == numel


def slice_of(value: Any, offset: int, length: int) -> Any:
    """A piece's own copy of a state value (a scalar tensor too: Adam steps it in place)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value[offset:offset + length].clone() if value.dim() >= 1 else value.clone()


def full_states(saved: Any, groups: list[list[torch.Tensor]]
                 ) -> tuple[dict[tuple[int, int], dict[str, Any]], list[dict[str, Any]]]:
    """((group, index in group) -> each state value over the whole parameter, flat), and
    the saved groups' hyperparameters, from shards or a plain state dict."""
    shards = [saved] if isinstance(saved, dict) and saved.get("format") == SHARD_FORMAT \
        else saved if isinstance(saved, (list, tuple)) else None
    if shards is None:
        if not isinstance(saved, dict) or "state" not in saved or "param_groups" not in saved:
            raise TypeError("state_dict: expected a ZeroOptimizer shard, a list of them, or "
                            "an optimizer state dict")
        return _from_plain(saved, groups)
    numels = [[p.numel() for p in g] for g in groups]
    full: dict[tuple[int, int], dict[str, Any]] = {}
    for n, shard in enumerate(shards):
        if not isinstance(shard, dict) or shard.get("format") != SHARD_FORMAT:
            raise TypeError(f"state_dict[{n}]: expected a ZeroOptimizer shard")
        if shard["numels"] != numels:
            raise ValueError(f"state_dict[{n}]: saved for other parameters (sizes "
                             f"{shard['numels']}, here {numels})")
        saved_state = shard["optimizer"]["state"]
        index = 0
        for k, placement in enumerate(shard["placement"]):
            for i, offset, length in placement:
                for key, value in saved_state.get(index, {}).items():
                    entry = full.setdefault((k, i), {})
                    if isinstance(value, torch.Tensor) and value.dim() >= 1:
                        if key not in entry:
                            entry[key] = torch.zeros(numels[k][i], dtype=value.dtype)
                        entry[key][offset:offset + length] = value
                    else:
                        entry[key] = value
                index += 1
    return full, _hyperparameters(shards[0]["optimizer"]["param_groups"])


def _from_plain(saved: dict[str, Any], groups: list[list[torch.Tensor]]
                ) -> tuple[dict[tuple[int, int], dict[str, Any]], list[dict[str, Any]]]:
    if [len(g["params"]) for g in saved["param_groups"]] != [len(g) for g in groups]:
        raise ValueError("state_dict: its param groups do not match the optimizer's")
    full, position = {}, {}
    for k, g in enumerate(saved["param_groups"]):
        for i, index in enumerate(g["params"]):
            position[index] = (k, i)
    for index, entry in saved["state"].items():
        k, i = position[index]
        full[(k, i)] = {key: value.reshape(-1) if is_sliced(value, groups[k][i].numel())
                        else value for key, value in entry.items()}
    return full, _hyperparameters(saved["param_groups"])


def _hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each saved group's entries but its parameters' indices."""
    return [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
