"""Communicators: the job's (from `init`) and any other a call names, each with its nodes
(ranks sharing memory), cross-node groups and per-communicator state.

A node is a set of ranks that share memory: MPI_COMM_TYPE_SHARED, or, to simulate several
nodes on one machine, consecutive blocks of `ranks_per_node` ranks. Ranks with the same
local rank on different nodes form a cross communicator (the hierarchical algorithms'
inter-node level).

A Topology is the one object per communicator and the unit of its lifetime. It owns what
the runtime keeps: the MPI duplicates, ranks and nodes, the CPUs each rank has, the
agreement channel (with its shared window where the group is one node), the stall limit
and the engine's counters (stats). Each upper layer keeps its own per-communicator state
in an object of its own class, hung here by state() and freed with the Topology: api's
descriptions and fast entries, `auto`'s choices and trials, process sets, the timeline's
recording, Horovod's names in flight, faults' failed ranks, the device path's CUDA IPC
workspaces. Only the layer that defines such a class writes it; another layer that needs
it changed calls a function of that layer. (shm's algorithm windows are an attribute of the
MPI communicator they run on, freed with it: algorithms/shm.window_of.) The watchdog and the Config are the
process's, shared by every communicator; the stall timeout is each communicator's
(set_timeout)."""

from __future__ import annotations

import atexit
import os
import socket
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from mpi4py import MPI

from collectives import config as _config
from collectives.kernels import _C
from collectives.runtime import agreement, faults, flight, p2p
from collectives.runtime.engine import ENGINE
from collectives.runtime.stragglers import Stragglers
from collectives.runtime.watchdog import Limit, Watchdog, bounded
from collectives.runtime.window import cpus, ranks_on_machine

S = TypeVar("S")


class Topology:
    """One communicator as collectives uses it. `comm` is a private duplicate of the user's
    communicator so our messages never match theirs. Creating one is collective over comm."""

    def __init__(self, comm: MPI.Comm, config: _config.Config, watchdog: Watchdog,
                 generation: int = 0, label: str | None = None):
        self.config, self.watchdog = config, watchdog
        self.generation = generation  # shrinks after failures that led to this job's comm
        ranks_per_node = config.ranks_per_node
        self.comm = comm.Dup()
        if config.fault_tolerant:
            # an MPI error raises instead of aborting, whatever the user's communicator
            # does; the communicators split from this one inherit it
            self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        if ranks_per_node is None:
            self.node_comm = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        else:
            if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
                raise ValueError(f"ranks_per_node: expected a positive int, got {ranks_per_node!r}")
            self.node_comm = self.comm.Split(self.rank // ranks_per_node, key=self.rank)
        self.local_rank, self.local_size = self.node_comm.Get_rank(), self.node_comm.Get_size()
        self.cross_comm = self.comm.Split(self.local_rank, key=self.rank)
        self.cross_rank, self.cross_size = self.cross_comm.Get_rank(), self.cross_comm.Get_size()
        # world ranks of each node, nodes ordered by their lowest world rank
        leaders = self.comm.allgather(self.node_comm.bcast(self.rank, root=0))
        self.nodes = [
            [r for r in range(self.size) if leaders[r] == leader]
            for leader in sorted(set(leaders))
        ]

        # fault-tolerant mode: each rank's (host, pid), to kill a rank declared failed that
        # still runs (runtime/faults.py)
        self.processes = self.comm.allgather((socket.gethostname(), os.getpid())) \
            if config.fault_tolerant else None
        self.max_local_size = max(len(node) for node in self.nodes)
        # CPUs per rank, the fewest of any rank's: those it may run on, at most an even share
        # of those its node's ranks run on among the processes of its machine
        # (algorithms/hierarchical.py overlaps its levels on two threads of each rank only
        # where every rank has two)
        mine = cpus()
        node_cpus = set().union(*self.node_comm.allgather(mine))
        self.cpus_per_rank = self.comm.allreduce(
            min(len(mine), len(node_cpus) // ranks_on_machine(self.local_size)), op=MPI.MIN)
        self.node_index = next(i for i, node in enumerate(self.nodes) if self.rank in node)
        self._shard_comms: list[MPI.Comm] | None = None
        # the agreement over shared memory where the group is one node that shares it
        self.window = agreement.shared_window(self.comm) if len(self.nodes) == 1 else None
        self.limit = Limit(config.stall_timeout_s)  # how long a call here waits for others
        for c in (self.comm, self.node_comm, self.cross_comm):  # every wait on them reads it
            self.limit.attach(c)
        if len(self.nodes) > 1:  # messages that may cross nodes go in eager-sized pieces
            for c in (self.comm, self.cross_comm):
                p2p.cap_messages(c, config.node_message_bytes)
        self.channel = agreement.channel(self.comm, watchdog, self.limit, self.window)
        # calls, bytes and waits: the engine writes them (C++); label: the flight recorder's
        # name of this communicator (the job's, or its members' job ranks)
        self.stats = _C.Stats(label if label is not None else _members(self.comm))
        self._states: dict[type, Any] = {}  # the upper layers' objects: state()

    def set_timeout(self, seconds: float | None) -> None:
        """How long a call on this communicator waits for the other ranks before it raises
        StallError (None: forever); COLLECTIVES_STALL_TIMEOUT_S until set."""
        if seconds is not None and not seconds >= 0:
            raise ValueError(f"timeout: expected seconds >= 0 or None, got {seconds!r}")
        self.limit.timeout_s = seconds
        self.channel.first_wait = self.watchdog.first_deadline(self.limit)

    def shard_owner(self, shard: int) -> int:
        """Local rank owning shard s of max_local_size shards: contiguous runs of shards go to
        each local rank, so a node smaller than the largest owns several."""
        return shard * self.local_size // self.max_local_size

    def shard_comm(self, shard: int) -> MPI.Comm:
        """The communicator of the ranks owning `shard` on every node (collective on first
        use: all ranks create all of them together)."""
        if self._shard_comms is None:
            self._shard_comms = [
                self.comm.Split(0 if self.shard_owner(s) == self.local_rank else MPI.UNDEFINED,
                                key=self.rank)
                for s in range(self.max_local_size)
            ]
            for c in self._shard_comms:
                if c != MPI.COMM_NULL:
                    self.limit.attach(c)
                    if len(self.nodes) > 1:  # one rank of each node
                        p2p.cap_messages(c, self.config.node_message_bytes)
        return self._shard_comms[shard]

    def comms(self) -> list[MPI.Comm]:
        """The MPI communicators this object made."""
        return [c for c in (self._shard_comms or []) + [self.cross_comm, self.node_comm,
                                                        self.comm] if c != MPI.COMM_NULL]

    def state(self, kind: type[S]) -> S:
        """The object of class `kind` that an upper layer keeps for this communicator: made
        by kind() on first use, found again by every later call, and freed with this
        Topology (free() calls its close(), if it has one), so a communicator rebuilt after
        a shrink or a growth starts from a clean state. Only the module that defines kind
        (or its package) asks for it; the others ask that module (tests/unit/
        test_state_owners.py checks it)."""
        found = self._states.get(kind)
        if found is None:
            found = self._states[kind] = kind()
        return found

    def free(self) -> None:
        """Free what this object made (collective over comm). After a failure of ranks
        (fault-tolerant mode) MPI lets the survivors free it without the dead."""
        if self.window is not None:
            self.window.free()
        states, self._states = list(self._states.values()), {}
        for state in states:
            close = getattr(state, "close", None)
            if close is not None:
                close()
        for c in self.comms():
            c.Free()


_topology: Topology | None = None
_keyval: int | None = None  # ties a Topology to the user's communicator it was made for


def init(comm: MPI.Comm | None = None, ranks_per_node: int | None = None) -> Topology:
    """Initialize once (later calls return the same topology); ranks_per_node defaults to
    the COLLECTIVES_RANKS_PER_NODE environment variable, else shared-memory nodes."""
    global _topology
    if _topology is None:
        if comm is not None and not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm: expected an mpi4py MPI.Comm, got {type(comm).__name__}")
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                "collectives needs MPI_THREAD_SERIALIZED or higher (its progress thread calls "
                "MPI); initialize MPI with mpi4py's default (MULTIPLE) or set "
                "mpi4py.rc.thread_level = 'serialized' before importing MPI")
        config = _config.from_env()
        if ranks_per_node is not None:
            config.ranks_per_node = ranks_per_node
        _config.set(config)
        comm = MPI.COMM_WORLD if comm is None else comm
        watchdog = Watchdog(comm, config.stall_warning_s)
        _topology = Topology(comm, config, watchdog, label="job")
        _watch(_topology)
        if not config.fault_tolerant:  # there a rank that exits is a failure survived
            _abort_on_uncaught_exceptions()
        else:
            atexit.register(_exit_after_failures)
        try:
            for fn in _on_init:
                fn(_topology)
        except BaseException:
            shutdown()
            raise
    return _topology


_on_init: list[Callable[[Topology], None]] = []


def shrink() -> Topology:
    """Replace the job's Topology by one over the ranks still alive, numbered in their old
    order, and return it: collective over the survivors, each of which calls it after
    RanksFailedError (fault-tolerant mode; collectives.elastic does). Everything the old one
    kept goes with it (nodes, windows, agreement channel, described calls, process sets,
    `auto`'s trials); the new one runs init's hooks again, with its `generation` one up."""
    old = get()
    if not old.config.fault_tolerant:
        raise RuntimeError("shrink: the job is not fault-tolerant (run it under "
                           "`mpirun --with-ft ulfm`, or set COLLECTIVES_FAULT_TOLERANT=1)")
    for c in old.comms():  # a survivor still inside a call on them returns from it
        try:
            c.Revoke()
        except MPI.Exception:
            pass
    return replace(old.comm.Shrink(), old.generation + 1)


#: Seconds a rebuild of the job's communicators (after a shrink) may take before
#: the job ends with an error, or the stall timeout if shorter. A rebuild takes milliseconds;
#: a rebuild that MPI does not finish ends the job with an error instead of hanging it.
REBUILD_TIMEOUT_S = 60.0


def replace(comm: MPI.Comm, generation: int) -> Topology:
    """Make the job's Topology one over comm (collective over comm), with `generation`, free
    the old one's windows and upper layers' state and run init's hooks: a shrink's
    survivors (collectives.elastic). comm itself is left as it is (the Topology works on a
    duplicate), unfreed by its callers."""
    global _topology
    old = get()
    limit = old.config.stall_timeout_s
    with bounded(REBUILD_TIMEOUT_S if limit is None else min(limit, REBUILD_TIMEOUT_S),
                 f"rebuilding the job's communicators ({old.size} to {comm.Get_size()} ranks)"):
        new = Topology(comm, old.config, Watchdog(comm, old.config.stall_warning_s),
                       generation, label=f"job.{generation}")
        _watch(new)
    old.watchdog.stop()
    try:
        old.free()
    except MPI.Exception:
        pass  # what MPI cannot free after the failure is the dead ranks' loss, not ours
    _topology = new
    for fn in _on_init:
        fn(new)
    return new


def _watch(job: Topology) -> None:
    """Start the job's flight recorder, and rank 0's straggler watch (collective)."""
    flight.start(ENGINE.native, job.comm, job.stats)
    if job.rank == 0 and job.config.straggler_share is not None:
        job.watchdog.stragglers = Stragglers(job.stats, job.size, job.config.straggler_share,
                                             job.config.straggler_window_s)


def on_init(fn: Callable[[Topology], None]) -> None:
    """Call fn(topology) at the end of every init, collectively: for what runs collectives
    over the new job (autotune.py's measurement), which this module cannot import."""
    _on_init.append(fn)


def of(comm: MPI.Comm | None) -> Topology:
    """The Topology a call runs over: the job's for None, else the one made for the mpi4py
    communicator comm on its first use (collective over comm, like any call on it) and
    freed with it."""
    if comm is None:
        return _topology if _topology is not None else init()
    if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm: expected an mpi4py MPI.Comm, got {comm!r}")
    global _keyval
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval(delete_fn=lambda _c, _k, topo: topo.free())
    topo = comm.Get_attr(_keyval)
    if topo is None:
        job = get()
        topo = Topology(comm, job.config, job.watchdog)
        comm.Set_attr(_keyval, topo)
    return topo


def _members(comm: MPI.Comm) -> str:
    """The job ranks of comm's members as text ("ranks 0-3,6"): the same on every member."""
    job = get().comm.Get_group()
    group = comm.Get_group()
    ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), job)
    group.Free()
    job.Free()
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return "ranks " + ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _abort_on_uncaught_exceptions() -> None:
    """An uncaught exception on one rank ends the whole job (MPI_Abort) instead of leaving
    the other ranks waiting forever in their next collective (outside fault-tolerant mode,
    where the rank's exit is a failure the others raise RanksFailedError for)."""
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        previous(kind, value, tb)
        # torch's init_process_group wraps this hook in one that points sys.stderr at a
        # buffer and writes the buffer out after the hook returns, which it never does:
        # what the hooks wrote goes to the process's stderr here
        out = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
        if sys.stderr is not out and hasattr(sys.stderr, "getvalue"):
            out.write(sys.stderr.getvalue())
        out.write(f"collectives: uncaught {kind.__name__} on rank "
                  f"{MPI.COMM_WORLD.Get_rank()}; aborting the job\n")
        out.flush()
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


def _exit_after_failures() -> None:
    """At exit, fault-tolerant mode, in a process that has seen ranks fail: it waits for the
    other survivors (a barrier on the shrunk job; none if it was not shrunk) and exits
    without MPI_Finalize, which after a failure can wait forever (for messages the failed
    call left in flight; in the failure detector's shutdown). Its status is 1 after an
    uncaught exception, else 0 (a sys.exit code is not seen here)."""
    failed = None if _topology is None else faults.failed(_topology)
    if _topology is None or (_topology.generation == 0 and failed is None):
        return
    if failed is None:
        try:
            _topology.comm.Barrier()
        except MPI.Exception:
            pass  # another failure: nothing left to wait for
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if getattr(sys, "last_value", None) is not None else 0)


def initialized() -> bool:
    """Whether init() has run (and shutdown() has not since)."""
    return _topology is not None


def get() -> Topology:
    """The topology, initializing with defaults on first use."""
    return _topology if _topology is not None else init()


def shutdown() -> None:
    """Free our communicators; a later call initializes again."""
    global _topology
    if _topology is not None:
        _topology.watchdog.stop()
        _topology.free()
        _topology = None


def _job_field(field: str) -> Callable[[], int]:
    """Horovod's accessor of the job's `field` (rank(), size(), ...), initializing with
    defaults on first use."""

    def read() -> int:
        return getattr(get(), field)

    read.__name__ = read.__qualname__ = field
    read.__doc__ = f"The job's {field.replace('_', ' ')} (initializing it on first use)."
    return read


rank = _job_field("rank")
size = _job_field("size")
local_rank = _job_field("local_rank")
local_size = _job_field("local_size")
cross_rank = _job_field("cross_rank")
cross_size = _job_field("cross_size")
