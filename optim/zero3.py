"""ZeRO stage 3's parameter sharding: each rank keeps only its piece of a unit's parameters,
and the unit is gathered just before it computes.

Units. A unit is a module whose parameters are gathered and freed together (by default each
child of the model that holds trainable parameters; a user can name others, such as each
transformer block). Its trainable parameters, one flat buffer per dtype and device, are a
ShardedBucket (optim/zero_buckets.py): the bucket layout of stage 2 (rank r owns [lo, hi),
the r-th even piece), except that this rank's piece lives in its own tensor (`shard`, which
the optimizer steps) and the flat buffer, which the parameters' .data view, holds memory
only while the unit is gathered (its storage is resized to zero bytes between uses).
Trainable parameters outside every unit, or in more than one (tied weights), stay whole on
every rank as in stage 2.

When. Hooks on each unit module: before its forward the unit is gathered (an allgather of
the shards), and the next unit's allgather is started (prefetch, async on the engine) so it
runs while this unit computes; after its forward the unit is freed (reshard_after_forward)
and a hook on its outputs gathers it again when backward reaches it, starting the previous
unit's allgather. Once backward has produced all of a unit's gradients, its reduce-scatter
is launched as in stage 2 and the unit is freed. step() steps the shards; the next forward
gathers them. Every rank runs the same forward, so every rank issues the same collectives
in the same order.

Cost per step: the parameters allgathered once in forward and once in backward (once with
reshard_after_forward=False) and the gradients reduce-scattered once: 1.5 allreduces' bytes
(1 without resharding), against stage 2's one. With hpZ the backward's allgather runs over
each node's ranks alone, from the pieces the forward kept (1/L of the parameters more
memory between a forward and its backward, L ranks a node), so only the forward's crosses
the network. Memory per rank: 1/N of the sharded parameters, gradients and optimizer
state, plus the units gathered at a time: the one computing and, with prefetch, the next
one (peak_gathered_bytes counts them, and hpZ's kept pieces; the allgather's own output
is a transient second copy of the unit being gathered). A regathered unit's memory is
fresh: it asks for huge pages, whose first touch costs 512x fewer faults.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from collectives import api as C
from collectives.runtime import topology

from .overlap import bucketed


class ShardedBuckets:
    """The units of one model: their buckets, the hooks that gather and free them, and the
    accounting of what is gathered (gathered_bytes, peak_gathered_bytes)."""

    def __init__(self, module: torch.nn.Module, units: list[torch.nn.Module],
                 process_set: Any, reshard_after_forward: bool, prefetch: bool,
                 node: tuple[Any, int, int] | None = None):
        self.module = module
        self.process_set = process_set
        # hpZ: (this node's process set, this rank's rank and the size in it), or None
        self.node = node
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.units: list[list[Any]] = [[] for _ in units]  # per unit, its buckets
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self._hooks: list = []
        self._modules = units

    @property
    def node_set(self) -> Any:
        """hpZ: the process set the backward's gathers run over (None: the global set)."""
        return None if self.node is None else self.node[0]

    def add(self, unit: int, bucket: Any) -> None:
        bucket.owner = self
        self.units[unit].append(bucket)

    def hook(self) -> None:
        """Register the gather and free hooks on every unit module, and on each module
        inside a unit that holds its sharded parameters a check that the unit is gathered
        (a clear error, not a read of freed storage, for a layer called on its own)."""
        for i, m in enumerate(self._modules):
            if not self.units[i]:
                continue
            sharded = {id(p) for b in self.units[i] for p in b.params}
            places = [(sub, name, p) for sub in m.modules()
                      for name, p in sub.named_parameters(recurse=False) if id(p) in sharded]
            self._hooks.append(m.register_forward_pre_hook(self._before_forward(i, places)))
            self._hooks.append(m.register_forward_hook(self._after_forward(i)))
            for name, sub in m.named_modules():
                if sub is not m and any(id(p) in sharded for p in sub.parameters(recurse=False)):
                    self._hooks.append(sub.register_forward_pre_hook(self._inside(i, name)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---- gathering
    def gather(self, unit: int) -> None:
        for b in self.units[unit]:
            b.gather()

    def start(self, unit: int) -> None:
        """Start unit's allgather (prefetch) if it is neither gathered nor on its way."""
        if self.prefetch and 0 <= unit < len(self.units):
            for b in self.units[unit]:
                b.start()

    def free_all(self) -> None:
        for buckets in self.units:
            for b in buckets:
                b.free()

    def forget_secondary(self) -> None:
        """hpZ: the kept pieces are stale once the optimizer has stepped."""
        for buckets in self.units:
            for b in buckets:
                b.drop_secondary()

    def held(self, delta: int) -> None:
        self.gathered_bytes += delta
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Collective: every unit gathered within the block (to read or save the whole
        model), freed after it."""
        try:
            for i in range(len(self.units)):
                self.gather(i)
            yield
        finally:
            self.free_all()

    # ---- hooks
    def _before_forward(self, unit: int, places: list):
        def hook(module: torch.nn.Module, args: Any) -> None:
            for sub, name, p in places:
                if getattr(sub, name, None) is not p:
                    raise RuntimeError(
                        f"ZeroOptimizer stage 3: parameter {name!r} of a "
                        f"{type(sub).__name__} in unit {type(module).__name__} was replaced "
                        f"after wrapping, so it is neither sharded nor stepped: change the "
                        f"model before building the optimizer")
            self.gather(unit)
            if self.node is not None and torch.is_grad_enabled():
                for b in self.units[unit]:
                    b.keep_secondary(self.node[1], self.node[2])
            self.start(unit + 1)
        return hook

    def _inside(self, unit: int, name: str):
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not all(b.gathered for b in self.units[unit]):
                raise RuntimeError(
                    f"ZeroOptimizer stage 3: {type(module).__name__} {name!r} of unit "
                    f"{type(self._modules[unit]).__name__} ran while the unit is not "
                    f"gathered (its parameters are sharded outside the unit's forward and "
                    f"backward): call it through its unit, make it a unit itself (units=), "
                    f"or run it within opt.gathered()")
        return hook

    def _after_forward(self, unit: int):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                tensors = [t for t in _tensors(output) if t.requires_grad]
                if tensors:
                    armed = [True]

                    def before_backward(grad: torch.Tensor) -> None:
                        if armed[0]:  # once per forward, at the first output's gradient
                            armed[0] = False
                            self.gather(unit)
                            self.start(unit - 1)
                    for t in tensors:
                        t.register_hook(before_backward)
            if self.reshard_after_forward:
                for b in self.units[unit]:
                    b.free()
        return hook


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (nested tuples, lists and dicts)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []


class _NodeSets:
    """The job's node process sets for hpZ, registered by the first ZeroOptimizer that asks
    and shared by every later one (each would otherwise register, and never free, its own
    communicators); a job rebuilt after a shrink or a growth starts without them."""

    __slots__ = ("mine", "node_sets")

    def __init__(self) -> None:
        self.mine: tuple[Any, int, int] | None = None  # node_group()'s answer
        self.node_sets: list[Any] = []  # every node's set (the same list on every rank)


def node_group() -> tuple[Any, int, int]:
    """Collective over the job on its first call (and again if a user removed the sets):
    (this rank's node as a process set, its rank in it, the node's size), registering one
    set per node (in node order, on every rank); the global set (None) when the job is one
    node."""
    held = topology.get().state(_NodeSets)
    if held.mine is not None and all(ps.process_set_id is not None for ps in held.node_sets):
        return held.mine
    nodes = C.allgather_object(C.cross_rank())
    members: dict[int, list[int]] = {}
    for r, node in enumerate(nodes):
        members.setdefault(node, []).append(r)
    if len(members) == 1:
        held.mine = (None, C.rank(), C.size())
        return held.mine
    order = sorted(members)
    held.node_sets = [C.add_process_set(members[node]) for node in order]
    mine = held.node_sets[order.index(nodes[C.rank()])]
    held.mine = (mine, mine.rank(), mine.size())
    return held.mine


def default_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Each child of module that holds a trainable parameter, in registration order (the
    order most models run them in, which prefetch follows)."""
    return [m for m in module.children() if any(p.requires_grad for p in m.parameters())]


def assign(module: torch.nn.Module, units: list[torch.nn.Module],
           trainable: list[torch.Tensor], threshold: int
           ) -> tuple[list[list[list[torch.Tensor]]], list[torch.Tensor]]:
    """(per unit, its trainable parameters in buckets of one dtype and device), and the
    trainable parameters kept whole: those in no unit or in several (tied weights)."""
    wanted = {id(p) for p in trainable}
    seen: dict[int, int] = {}
    for i, m in enumerate(units):
        for p in m.parameters():
            if id(p) in wanted:
                seen[id(p)] = -1 if id(p) in seen and seen[id(p)] != i else i
    mine: list[list[torch.Tensor]] = [[] for _ in units]
    whole = []
    for p in trainable:
        i = seen.get(id(p), -1)
        (whole if i < 0 else mine[i]).append(p)
    return [bucketed(list(reversed(ps)), threshold) for ps in mine], whole


def check_units(module: torch.nn.Module, units: Any, trainable: list[torch.Tensor]
                ) -> list[torch.nn.Module]:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: stage 3 needs the model (a torch.nn.Module) to gather its "
                        f"units around their forward; got {type(module).__name__}")
    units = default_units(module) if units is None else list(units)
    for m in units:
        if not isinstance(m, torch.nn.Module) or not any(m is s for s in module.modules()):
            raise ValueError("units: expected submodules of module")
    if len({id(m) for m in units}) != len(units):
        raise ValueError("units: a module is named twice")
    inside = {id(p) for p in module.parameters()}
    if any(id(p) not in inside for p in trainable):
        raise ValueError("module: the optimizer has parameters that are not module's")
    return units

