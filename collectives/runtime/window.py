"""A shared-memory window: one segment per rank of ranks that share a node, made with
MPI.Win.Allocate_shared, holding three counters, a failure flag and `depth` staging buffers.

Chunk g (numbered across calls on the window, by its C++ side, which every call begins
through) uses buffer g % depth. A counter is a number
of chunks done, written only by its owner after a full memory fence and read by the others
before one, so a reader that sees chunk g counted also sees its data. Every stage runs in
C++ on the layout handed over here (`native`; csrc/runtime/shm_sync.h posts and waits).

Two owners make windows: collectives/algorithms/shm.py (its collectives' pipelines, one
window per communicator, grown on demand) and the agreement channel of a communicator whose
ranks share memory (collectives/runtime/agreement.py: the shared-memory exchange)."""

from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np
from mpi4py import MPI

from collectives import config, kernels

#: Seconds a waiting rank polls before it yields its core between polls (at once where the
#: cores are oversubscribed: then the rank waited for may need this core).
SPIN_SECONDS = 1e-3
_HEADER = 4096  # counters page at the start of each segment
_PAGE = 4096
_STRIDE = 16  # int64s between counters: each on its own 128-byte line pair


def cpus() -> set[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def cores() -> int:
    """Cores this process may run on."""
    return len(cpus())


def ranks_on_machine(comm_size: int) -> int:
    """MPI processes sharing this machine's cores: the launcher's count of local ranks where
    it says (Open MPI, MPICH), which also covers simulated nodes, else comm_size."""
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(var, "").isdigit():
            return max(int(os.environ[var]), comm_size)
    return comm_size


def oversubscribed(comm_size: int) -> bool:
    """Whether more processes share this machine's cores than it has: more MPI ranks than
    cores, or the job says so to Open MPI (mpi_yield_when_idle, which makes MPI's own waits
    yield; hosts emulated on one machine share its cores though each sees only its own
    ranks)."""
    told = os.environ.get("OMPI_MCA_mpi_yield_when_idle", "").lower() in ("1", "true", "yes")
    return told or ranks_on_machine(comm_size) > cores()


def shares_memory(comm: MPI.Comm) -> bool:
    """Whether every rank of comm is on this rank's node (collective over comm)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    shared = node.Get_size() == comm.Get_size()
    node.Free()
    return shared


#: Every window this process holds (mark_failed tells their ranks).
_live: weakref.WeakSet[Window] = weakref.WeakSet()


def mark_failed() -> None:
    """Tell the ranks of every window this process holds that it met a failure: their waits
    for it raise PeerFailure instead of waiting for a post that will not come (fault-tolerant
    mode; runtime/faults.py)."""
    for w in list(_live):
        w.native.mark_failed()


class Window:
    """One communicator's shared window: each rank's counters and staging buffers
    (collective over comm to make and to free). stall_seconds bounds a wait (inf: never);
    limit (a _C.StallLimit), where given, is read in its place as each wait starts.
    Its stages run in C++ on `native`, which also numbers the chunks (the same on every
    rank)."""

    __slots__ = ("win", "slot_bytes", "native", "__weakref__")

    def __init__(self, comm: MPI.Comm, slot_bytes: int, depth: int, stall_seconds: float,
                 limit: Any = None):
        self.slot_bytes = slot_bytes
        rank, size = comm.Get_rank(), comm.Get_size()
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # page-aligned segments, first-touched locally
        self.win = MPI.Win.Allocate_shared(_HEADER + depth * slot_bytes, 1, info, comm)
        info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)  # Win.Sync needs a passive-target epoch
        raw = [self.win.Shared_query(j)[0] for j in range(size)]
        # MPI does not promise zeroed memory (a one-rank window comes from malloc): zero our
        # counters, and let no rank read a peer's before the peer has. Zeroing the whole
        # segment also faults its pages in now, and reading a byte of every page of every
        # segment maps them here: otherwise the first `depth` chunks of the calls after a
        # window is made pay a page fault per 4 KiB in each process, which costs those calls
        # several times their steady time: enough to lose an online trial (auto/online.py),
        # whose first calls of a class are the ones it times.
        np.frombuffer(raw[rank], np.uint8)[:] = 0
        self.win.Sync()
        comm.Barrier()
        for segment in raw:
            int(np.frombuffer(segment, np.uint8)[::_PAGE].sum())
        spin_seconds = 0.0 if oversubscribed(size) else SPIN_SECONDS
        # fault-tolerant mode: a long wait checks that the rank it waits for is alive
        pids = comm.allgather(os.getpid()) if config.get().fault_tolerant else []
        self.native = kernels.shm_window(
            [np.frombuffer(b, np.uint8).ctypes.data for b in raw], rank, _HEADER, _STRIDE,
            slot_bytes, depth, spin_seconds, stall_seconds, pids, limit)
        _live.add(self)

    def free(self) -> None:
        _live.discard(self)
        self.native.close()  # a C++ entry still holding it must not touch the memory
        self.win.Unlock_all()
        self.win.Free()
