"""The drop-in's shared pieces: Horovod's ops and errors, its argument rules (average /
op, process sets, Average as a scaled Sum), async names in flight and what barrier() waits
for."""

from __future__ import annotations

import threading
from typing import Any

import torch

from collectives import api as _C
from collectives.api import process_sets as _process_sets
from collectives.api.process_sets import (
    global_process_set,
)
from collectives.elastic import membership
from collectives.ops import ReduceOp
from collectives.runtime import meet as _meet
from collectives.runtime import topology as _topology
from collectives.runtime.engine import Handle

Average, Sum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max,
                                   ReduceOp.Product)
#: Horovod's Adasum op (collectives/api/adasum.py).
Adasum = "Adasum"

#: Raised when a collective cannot complete (Horovod's name for it): a stall timeout, or
#: ranks that died (its subclass RanksFailedError, in fault-tolerant mode).
HorovodInternalError = _C.StallError


#: Raised by an elastic commit at which the launcher moves the job to new hosts
#: (collectives.elastic).
HostsUpdatedInterrupt = membership.HostsUpdatedInterrupt


# -------------------------------------------------------------------------- arguments

def op_of(average: Any, op: Any) -> Any:
    """Horovod's rule: op supersedes the deprecated average; neither means Average."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return Sum if average is False else Average
    return op


def set_of(process_set: Any) -> Any:
    return None if process_set is global_process_set else process_set


def topology_of(process_set: Any):
    return _process_sets.resolve(None, set_of(process_set))


def as_horovod(op: Any, postscale: Any, process_set: Any) -> tuple[Any, Any]:
    """Horovod's Average: a Sum scaled by postscale / size, the set's whole size even while
    some ranks have joined (they count as zeros), and integers scaled in float64 and
    truncated; so Average travels as that Sum."""
    if op is not Average:
        return op, postscale
    return Sum, postscale / topology_of(process_set).size


class Named:
    """What the drop-in keeps per communicator (the job's, and each process set's).
    in_flight (used on the job's): names of async calls in flight, which stay taken until
    synchronize(), a poll() that found them finished, or a barrier() that waited for them.
    Horovod frees a name when its call finishes, which takes at least a cycle of its
    coordinator; here a call may finish within microseconds, so a name stays taken until the
    caller has seen it finish, and a barrier is such a sight: Horovod scripts drop handles
    and reuse their names after one. started and
    outstanding: the async calls started so far, and those not known finished with their
    place in that count: what barrier() waits for."""

    __slots__ = ("in_flight", "started", "outstanding")

    def __init__(self) -> None:
        self.in_flight: dict[str, Handle] = {}
        self.started = 0
        self.outstanding: list[tuple[int, Handle]] = []


_lock = threading.Lock()  # guards every communicator's Named


def start_named(name: str | None, process_set: Any, start) -> Handle:
    """Start an async call under name, refusing a name still in flight (as Horovod), and
    count it for barrier()."""
    named = topology_of(process_set).state(Named)
    in_flight = _topology.get().state(Named).in_flight
    with _lock:
        if name is not None and name in in_flight:
            raise ValueError(f"Requested to collect a tensor with the same name as another "
                             f"tensor that is currently being processed ({name!r}). If you "
                             f"want to request another tensor, use a different tensor name.")
        handle = start()
        if name is not None:
            in_flight[name] = handle
        index = named.started
        named.started = index + 1
        named.outstanding = [(i, h) for i, h in named.outstanding if not h.done()] \
            + [(index, handle)]
    return handle


def synchronize(handle: Handle) -> Any:
    """Wait for an async call; its result."""
    try:
        return _C.synchronize(handle)
    finally:
        _seen_finished(handle)


def poll(handle: Handle) -> bool:
    if not _C.poll(handle):
        return False
    _seen_finished(handle)
    return True


def _seen_finished(handle: Handle) -> None:
    """The caller has seen handle's call finish: its name is free again."""
    if not _topology.initialized():
        return
    in_flight = _topology.get().state(Named).in_flight
    with _lock:
        for name, h in list(in_flight.items()):
            if h is handle:
                del in_flight[name]


def refuse_adasum(op: Any, collective: str) -> None:
    if op == Adasum:  # a RuntimeError, as Horovod's
        raise NotImplementedError(f"op: {collective} does not support Adasum")


def wants_grad(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


# ------------------------------------------------------------------- join, barrier, more

def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' allreduces until every rank
    has joined; returns the last rank to join. device: Horovod's, unused (no GPU queues)."""
    return _C.join()


def barrier(process_set=global_process_set) -> None:
    """Every rank of the set reaches this point before any leaves, and the async calls that
    every rank started before it have finished. As Horovod's (whose coordinator runs the
    barrier after the calls ready on every rank), it is not held up by a call that only
    some ranks have started, even one the others start only after it: the ranks meet
    beside the engine (collectives/runtime/meet.py), agreeing on how many async calls all of them
    started, and then wait for those. Below MPI_THREAD_MULTIPLE it is the library's
    barrier, behind every outstanding call. The names of the calls it waited for are free
    again, as in Horovod, whose calls free their names as they finish."""
    topo = topology_of(process_set)
    named = topo.state(Named)
    with _lock:
        started, pending = named.started, list(named.outstanding)
    if _meet.available():
        everyone = _meet.meet(topo, started)
    else:
        _C.barrier(process_set=set_of(process_set))
        everyone = started
    for index, handle in pending:
        if index < everyone:
            try:
                handle.wait()  # its error, if any, stays for synchronize()
            except Exception:  # the caller's synchronize() raises it
                pass
            _seen_finished(handle)

