"""Process sets (Horovod's): named groups of the job's ranks that run collectives among
themselves, each over its own communicator (its own agreement, shm window, described calls
and stats, through topology.of).

Adding and removing a set is collective over the whole job: every rank calls
add_process_set / remove_process_set with the same ranks in the same order (checked by the
agreement, so a difference raises MismatchError everywhere). Ranks outside a set hold its
object too but cannot call collectives on it. Sets may overlap. A set's ranks are job ranks,
and so is a root_rank given with process_set= (as in Horovod)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from collectives.api import calls, timeline
from collectives.runtime import topology
from collectives.runtime.engine import Job


class ProcessSet:
    """A set of the job's ranks that runs collectives together. Make one from a list of
    ranks, then register it with add_process_set() (or init(process_sets=[...]))."""

    process_set_id: int | None = None
    ranks: list[int] | None = None

    def __init__(self, ranks: Sequence[int]):
        if isinstance(ranks, MPI.Comm):
            raise TypeError("ranks: a ProcessSet is made from a list of job ranks; to run "
                            "collectives over an mpi4py communicator, pass comm= instead")
        try:
            values = sorted(ranks)
        except TypeError:
            raise TypeError(f"ranks: expected a sequence of ints, got {ranks!r}") from None
        if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool)
                   for r in values):
            raise TypeError(f"ranks: expected a sequence of ints, got {ranks!r}")
        values = [int(r) for r in values]
        if len(set(values)) != len(values):
            raise ValueError(f"ranks: each rank at most once, got {ranks!r}")
        self.ranks = values
        self._comm: MPI.Comm | None = None  # this set's communicator, on its member ranks

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self._registered())

    def rank(self) -> int:
        """This rank's index in the set (its rank in the set's collectives); -1 outside."""
        ranks = self._registered()
        me = topology.get().rank
        return ranks.index(me) if me in ranks else -1

    def included(self) -> bool:
        """Whether this rank belongs to the set."""
        return topology.get().rank in self._registered()

    def topology(self) -> topology.Topology:
        """The Topology a collective with process_set=self runs over; ValueError if this
        rank is not in the set or the set is not registered."""
        if self.process_set_id == 0:
            return topology.get()
        ranks = self._registered()
        if self._comm is None:
            raise ValueError(f"process_set: rank {topology.get().rank} is not in this process "
                             f"set (ranks {ranks}); only its members may call collectives on it")
        return topology.of(self._comm)

    def _registered(self) -> list[int]:
        if self.process_set_id is None:
            raise ValueError(f"process_set: {self} is not registered; pass it to "
                             "add_process_set() (or init(process_sets=...)) on every rank first")
        return self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


#: The set of every rank of the job (id 0); its ranks follow the job's size (init, shrink).
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _sync_global(job: topology.Topology) -> None:
    global_process_set.ranks = list(range(job.size))


topology.on_init(_sync_global)


class Registered:
    """The sets registered over the job's communicator, by id, and the last id given (ids
    are never reused within a job, and equal on every rank)."""

    __slots__ = ("sets", "last_id")

    def __init__(self) -> None:
        self.sets: dict[int, ProcessSet] = {}
        self.last_id = 0


def _add(job: topology.Topology, process_set: ProcessSet) -> tuple[calls.Call, Job]:
    ranks = process_set.ranks
    bad = [r for r in ranks if not 0 <= r < job.size]
    if bad or not ranks:
        raise ValueError(f"process_set: ranks must be a non-empty list of job ranks in "
                         f"[0, {job.size}), got {ranks}")
    if process_set.process_set_id is not None:
        raise ValueError(f"process_set: {process_set} is registered already")
    call = calls.describe(job, "add_process_set", (("ranks", tuple(ranks)),), "mpi")

    def move() -> ProcessSet:
        member = job.rank in ranks
        comm = job.comm.Split(0 if member else MPI.UNDEFINED, key=job.rank)
        registered = job.state(Registered)
        registered.last_id += 1
        process_set.process_set_id = registered.last_id
        process_set._comm = comm if member else None
        registered.sets[registered.last_id] = process_set
        return process_set

    return call, Job(move)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of job ranks) and return it. Collective
    over the whole job: every rank adds the same sets in the same order."""
    job = topology.get()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    with calls.Prepared(job, "add_process_set", None) as p:
        p.call, p.job = _add(job, process_set)
    return p.run()


def _remove(job: topology.Topology, process_set: Any) -> tuple[calls.Call, Job]:
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set: expected a ProcessSet, got {type(process_set).__name__}")
    key = process_set.process_set_id
    if key != 0 and job.state(Registered).sets.get(key) is not process_set:
        raise ValueError(f"process_set: {process_set} is not registered")
    call = calls.describe(job, "remove_process_set", (("process_set_id", key),), "mpi")

    def move() -> bool:
        if key == 0:
            return False  # the global set stays
        del job.state(Registered).sets[key]
        if process_set._comm is not None:
            process_set._comm.Free()  # frees its Topology with it (topology.of)
        process_set._comm = None
        process_set.process_set_id = None
        return True

    return call, Job(move)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set and free its communicator; collective over the whole job.
    Returns whether it was removed (the global set never is)."""
    job = topology.get()
    with calls.Prepared(job, "remove_process_set", None) as p:
        p.call, p.job = _remove(job, process_set)
    return p.run()


def resolve(comm: Any, process_set: Any) -> topology.Topology:
    """The Topology a collective runs over, from its comm= and process_set= arguments."""
    if process_set is None or process_set is global_process_set:
        return topology.of(comm)
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set: expected a ProcessSet, got {type(process_set).__name__}")
    if comm is not None:
        raise ValueError("comm, process_set: pass one or the other, not both")
    return process_set.topology()


def job_ranks(process_set: Any) -> list[int] | None:
    """The job ranks of process_set (a root_rank given with it is one of them), or None
    for the global set or no set (root_rank is then a rank of the call's communicator)."""
    if process_set is None or process_set is global_process_set:
        return None
    return process_set.ranks


def init(comm: MPI.Comm | None = None, ranks_per_node: int | None = None,
         process_sets: Sequence[ProcessSet | Sequence[int]] | None = None) -> None:
    """Initialize the library (topology.init), register process_sets, in order, as
    add_process_set would (collective: every rank passes the same sets), and start the
    timeline if COLLECTIVES_TIMELINE names a file."""
    started = topology.initialized()
    job = topology.init(comm, ranks_per_node)
    for process_set in process_sets or ():
        add_process_set(process_set)
    if not started and job.config.timeline and not timeline.active():
        timeline.start_timeline(job.config.timeline, job.config.timeline_mark_cycles)


def shutdown() -> None:
    """Write the timeline if one is being recorded, free every registered set's
    communicator, then the job's (topology.shutdown); a later call initializes again."""
    if timeline.active():
        timeline.stop_timeline()
    if topology.initialized():
        for process_set in topology.get().state(Registered).sets.values():
            if process_set._comm is not None:
                process_set._comm.Free()
            process_set._comm = None
            process_set.process_set_id = None
    topology.shutdown()
