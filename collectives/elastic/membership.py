"""How many ranks an elastic job is meant to have, and how it gets there.

The target is `run`'s max_size, else Config.elastic_max_size; with a host-discovery source
(`run`'s discovery, else Config.elastic_discovery: elastic/discovery.py) it is the slots
the source lists, capped by max_size when both are set. Without either the job only
shrinks (growth is opted into: across hosts a join can hang, docs/elastic.md says why). After
ranks died and the survivors shrank, rank 0 starts replacements for the missing ranks
(runtime/spawn.py: on a thread, nothing waits for them); when the source lists more slots
than the job has ranks, rank 0 starts the new ranks the same way at a commit. At every
commit of a job that may grow, rank 0 tells every rank whether a batch of new processes is
ready (one small broadcast; a job at its max_size, or one that has grown, pays nothing);
if one is, every rank raises HostsUpdatedInterrupt from the commit, and `run` takes the
batch in (grow) and starts the function again from that commit, synced from rank 0. A new
process runs the program from its start and, in `run`, waits to be taken in (join).

Open MPI 5.0.11 spawns only until the job has grown once ("PRTE ERROR: Not found" after
that, the new process left hanging in MPI_Init): so the first failure's ranks are replaced,
or the job grows once into discovered slots, and later the job only shrinks."""

from __future__ import annotations

import math
import sys

from mpi4py import MPI

from collectives import config as _config
from collectives.api.gather import broadcast_object
from collectives.elastic.discovery import Discovery
from collectives.runtime import spawn, topology


class HostsUpdatedInterrupt(RuntimeError):
    """Raised on every rank by a commit at which replacements join the job (Horovod's name):
    collectives.elastic.run catches it, takes them in and calls the function again from
    that commit. skip_sync: Horovod's field; the state is always synced here, as the new
    ranks need it."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("ranks join the job at this commit")
        self.skip_sync = skip_sync


_target: int | None = None  # max_size: the most ranks the job grows to (set by run)
_discovery: Discovery | None = None  # where the slots to grow into are listed (set by run)
_joined = False  # a replacement: whether it is in the job yet
_grown = False  # whether new processes joined the job (then Open MPI spawns no more)
_asked: int | None = None  # rank 0: the target its last spawn for discovered slots was for


def set_target(max_size: int | None, discovery: str | None = None) -> None:
    """At the start of run: the most ranks to grow to, if any (a replacement learns the
    job's when it joins), and the host-discovery source, if any."""
    global _target, _discovery
    if max_size is None:
        max_size = _config.get().elastic_max_size
    if max_size is not None:
        _target = max_size
    if discovery is None:
        discovery = _config.get().elastic_discovery
    if discovery is not None and (_discovery is None or _discovery.source != discovery):
        _discovery = Discovery(discovery)


def _grows() -> bool:
    """Whether the job may grow at all (the same answer on every rank)."""
    return _target is not None or _discovery is not None


def _goal() -> int | None:
    """Rank 0: the size the job should have now: the slots discovery lists, capped by
    max_size; max_size alone without discovery; None before discovery's first listing
    (a later commit's _discover acts on it)."""
    if _discovery is None:
        return _target
    listed = _discovery.slots()
    if listed is None or _target is None:
        return listed
    return min(listed, _target)


def is_replacement() -> bool:
    """Whether this process was spawned to replace a rank and has not joined the job yet."""
    return not _joined and spawn.parent() is not None


def replace_missing() -> None:
    """After a shrink: rank 0 starts the ranks the job lacks, less those already starting
    (a batch rank 0 started before survives the shrink; one whose rank 0 died does not).

    Only after the job's first failure (generation 1): with Open MPI 5.0.11 a spawn after
    the job has grown once fails in the launcher ("PRTE ERROR: Not found") and leaves the
    new process hanging in MPI_Init, so later failures shrink the job without replacing."""
    topo = topology.get()
    if topo.rank == 0 and _grows() and topo.generation == 1:
        goal = _goal()
        missing = 0 if goal is None else goal - topo.size - spawn.pending()
        if missing > 0:
            spawn.start(missing)


def check() -> None:
    """At a commit: raise HostsUpdatedInterrupt on every rank if rank 0 has a batch of new
    processes ready (collective while the job may grow: it has not grown yet and is below
    its max_size); rank 0 first starts the ranks newly discovered slots add."""
    topo = topology.get()
    if not _grows() or _grown or topo.size >= (_target or math.inf) \
            or not topo.config.fault_tolerant:
        return
    if topo.rank == 0:
        _discover(topo.size)
    if broadcast_object(topo.rank == 0 and spawn.ready() is not None, 0):
        raise HostsUpdatedInterrupt()


def _discover(size: int) -> None:
    """Rank 0, at a commit of a job that has not grown (check): start the ranks that
    discovered slots add to a job of size ranks, once per target, while nothing is
    starting."""
    global _asked
    if _discovery is None or spawn.pending():
        return
    goal = _goal()
    if goal is not None and goal > size and goal != _asked:
        _asked = goal
        spawn.start(goal - size)


def grow() -> None:
    """Every rank of the job, after HostsUpdatedInterrupt: take a ready batch in (rank 0
    found one at the commit, and a batch stays ready until it joins)."""
    global _grown
    topo = topology.get()
    _grown = True
    comm = spawn.join(topo.comm, spawn.ready() if topo.rank == 0 else None)
    comm.bcast((topo.generation + 1, _target), root=0)
    topology.replace(comm, topo.generation + 1)


def join() -> None:
    """A replacement, in run: meet the job at its next commit and become its last ranks.
    Exits (status 0, saying why) if the job abandoned it (ended, or lost ranks, first)."""
    global _joined, _target, _grown
    _grown = True
    try:
        comm = spawn.join_job(MPI.COMM_WORLD.Dup(), spawn.parent())
        if comm is not None:
            generation, _target = comm.bcast(None, root=0)
    except MPI.Exception as exc:
        comm, why = None, f" ({exc})"
    else:
        why = ""
    if comm is None:  # not an error of the job's: the process ends quietly, status 0
        print(f"collectives.elastic: the job this replacement was started for ended or "
              f"lost ranks before it could join{why}; exiting", file=sys.stderr, flush=True)
        raise SystemExit(0)
    _joined = True
    topology.replace(comm, generation)
