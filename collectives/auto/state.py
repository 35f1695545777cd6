"""What `auto` keeps per communicator: one AutoState on each Topology (topology.state),
made on the communicator's first `auto` call and freed with it, so a communicator rebuilt
after a shrink or a growth chooses afresh for its new size.

Written only by auto's modules: select.py (the memo of the model's choices), online.py
(trials, settled classes, watches, classes rechecked), autotune.py (the cache's memory, on
the job's communicator). A layer above that keeps what a choice made (api's call
descriptions and fast entries) registers a function with on_change(), called when a class's
choice changes; auto never writes that layer's state itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collectives.runtime.topology import Topology


class AutoState:
    """One communicator's `auto`: settled classes (class -> algorithm, None for the
    estimate's), the trials running, the watches of settled classes and the classes
    already tried again because a trial misjudged them (online.py), the cache's settled
    classes (autotune.Memory, None where no cache is kept) and the memo of the model's
    fastest algorithm per (collective, nbytes), valid for `version` of the estimates'
    inputs (select.py)."""

    __slots__ = ("settled", "trials", "watches", "rechecked", "memory", "memo", "version")

    def __init__(self) -> None:
        self.settled: dict[int, str | None] = {}
        self.trials: dict[int, Any] = {}
        self.watches: dict[int, Any] = {}
        self.rechecked: set[int] = set()
        self.memory: Any = None
        self.memo: dict[tuple[str, int], str] = {}
        self.version = -1


def of(topo: Topology) -> AutoState:
    """topo's AutoState."""
    return topo.state(AutoState)


#: Called as fn(topo, entries) when a class's choice on topo changes: descriptions made
#: under the old choice are stale, and with entries the fast entries too.
_listeners: list[Callable[[Topology, bool], None]] = []


def on_change(fn: Callable[[Topology, bool], None]) -> None:
    """Call fn(topo, entries) whenever a settled choice on topo changes (online.py): a class
    settles (entries False: fast entries are registered only for the settled algorithm, so
    they stay valid) or is tried again (entries True: they go too)."""
    _listeners.append(fn)


def changed(topo: Topology, entries: bool) -> None:
    """A settled choice on topo changed: tell the layers that keep what it made."""
    for fn in _listeners:
        fn(topo, entries)
