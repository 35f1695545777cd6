"""How many ranks an elastic job is meant to have, and how it gets back there.

The target is `run`'s max_size, else Config.elastic_max_size; without one the job only
shrinks (growth is opted into: across hosts a join can hang, README.md says why). After
ranks died and the survivors shrank, rank 0 starts replacements for the
missing ranks (runtime/spawn.py: on a thread, nothing waits for them). At every commit of a
job smaller than its target, rank 0 tells every rank whether a batch of replacements is
ready (one small broadcast; a job at its target pays nothing); if one is, every rank raises
HostsUpdatedInterrupt from the commit, and `run` takes the batch in (grow) and starts the
function again from that commit, synced from rank 0. A replacement runs the program from
its start and, in `run`, waits to be taken in (join)."""

from __future__ import annotations

import sys

from mpi4py import MPI

from collectives import config as _config
from collectives.api.gather import broadcast_object
from collectives.runtime import spawn, topology


class HostsUpdatedInterrupt(RuntimeError):
    """Raised on every rank by a commit at which replacements join the job (Horovod's name):
    collectives.elastic.run catches it, takes them in and calls the function again from
    that commit. skip_sync: Horovod's field; the state is always synced here, as the new
    ranks need it."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("ranks join the job at this commit")
        self.skip_sync = skip_sync


_target: int | None = None  # the size the job grows back to (set by run)
_joined = False  # a replacement: whether it is in the job yet


def set_target(max_size: int | None) -> None:
    """At the start of run: the size to grow back to, if any (a replacement learns the
    job's when it joins)."""
    global _target
    if max_size is None:
        max_size = _config.get().elastic_max_size
    if max_size is not None:
        _target = max_size


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
    if topo.rank == 0 and _target is not None and topo.generation == 1:
        missing = _target - topo.size - spawn.pending()
        if missing > 0:
            spawn.start(missing)


def check() -> None:
    """At a commit: raise HostsUpdatedInterrupt on every rank if rank 0 has a batch of
    replacements ready (collective while the job is below its target)."""
    topo = topology.get()
    if _target is None or topo.size >= _target or not topo.config.fault_tolerant:
        return
    if broadcast_object(topo.rank == 0 and spawn.ready() is not None, 0):
        raise HostsUpdatedInterrupt()


def grow() -> None:
    """Every rank of the job, after HostsUpdatedInterrupt: take a ready batch in (rank 0
    found one at the commit, and a batch stays ready until it joins)."""
    topo = topology.get()
    comm = spawn.join(topo.comm, spawn.ready() if topo.rank == 0 else None)
    comm.bcast((topo.generation + 1, _target), root=0)
    topology.replace(comm, topo.generation + 1)


def join() -> None:
    """A replacement, in run: meet the job at its next commit and become its last ranks.
    Exits (status 0, saying why) if the job abandoned it (ended, or lost ranks, first)."""
    global _joined, _target
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
