"""A shared-memory window: one segment per rank of ranks that share a node, made with
MPI.Win.Allocate_shared, holding three counters and `depth` staging buffers.

Chunk g (numbered across calls on the window) uses buffer g % depth. A counter is a number
of chunks done, written only by its owner after MPI.Win.Sync (a full memory fence) and read
by the others before a Sync, so a reader that sees chunk g counted also sees its data. The
same layout is handed to C++ (`native`, csrc/runtime/shm_sync.h), which posts and waits with
the same ordering, so Python and C++ stages may run on one window in any mix.

Two owners make windows: collectives/algorithms/shm.py (its collectives' pipelines, one
window per communicator, grown on demand) and the agreement channel of a communicator whose
ranks share memory (collectives/agreement.py: the shared-memory exchange)."""

from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI

from . import kernels

#: Seconds a waiting rank polls before it yields its core between polls (at once when the
#: machine runs more ranks than it has cores: then the rank waited for may need this core).
SPIN_SECONDS = 1e-3
#: Counters: chunks copied in, reduced, and done with (their buffers free again).
READY, REDUCED, DONE = 0, 1, 2
_COUNTERS = ("READY", "REDUCED", "DONE")
_HEADER = 4096  # counters page at the start of each segment
_STRIDE = 16  # int64s between counters: each on its own 128-byte line pair


def cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ranks_on_machine(comm_size: int) -> int:
    """MPI processes sharing this machine's cores: the launcher's count of local ranks where
    it says (Open MPI, MPICH), which also covers simulated nodes, else comm_size."""
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(var, "").isdigit():
            return max(int(os.environ[var]), comm_size)
    return comm_size


def shares_memory(comm: MPI.Comm) -> bool:
    """Whether every rank of comm is on this rank's node (collective over comm)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    shared = node.Get_size() == comm.Get_size()
    node.Free()
    return shared


class Window:
    """One communicator's shared window: each rank's counters and staging buffers
    (collective over comm to make and to free). stall_seconds bounds a wait (inf: never)."""

    __slots__ = ("win", "rank", "size", "slot_bytes", "depth", "flags", "segments", "native",
                 "typed", "seq", "spin_seconds", "stall_seconds")

    def __init__(self, comm: MPI.Comm, slot_bytes: int, depth: int, stall_seconds: float):
        self.slot_bytes, self.depth = slot_bytes, depth
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # page-aligned segments, first-touched locally
        self.win = MPI.Win.Allocate_shared(_HEADER + depth * slot_bytes, 1, info, comm)
        info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)  # Win.Sync needs a passive-target epoch
        raw = [self.win.Shared_query(j)[0] for j in range(self.size)]
        self.flags = [memoryview(b)[:_HEADER].cast("q") for b in raw]
        # MPI does not promise zeroed memory (a one-rank window comes from malloc): zero our
        # counters, and let no rank read a peer's before the peer has
        np.frombuffer(raw[self.rank], np.uint8, _HEADER)[:] = 0
        self.win.Sync()
        comm.Barrier()
        self.segments = [np.frombuffer(b, np.uint8, depth * slot_bytes, _HEADER) for b in raw]
        self.typed: dict[np.dtype, list[np.ndarray]] = {}
        self.seq = 0  # chunks done so far on this window by Python, the same on every rank
        self.spin_seconds = SPIN_SECONDS if ranks_on_machine(self.size) <= cores() else 0.0
        self.stall_seconds = stall_seconds
        self.native = kernels.shm_window(  # the same layout for the C++ stages
            [np.frombuffer(b, np.uint8).ctypes.data for b in raw], self.rank, _HEADER, _STRIDE,
            slot_bytes, depth, self.spin_seconds, self.stall_seconds)

    def data(self, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's buffers as one flat array of dtype (cached per dtype)."""
        views = self.typed.get(dtype)
        if views is None:
            views = self.typed[dtype] = [s.view(dtype) for s in self.segments]
        return views

    def offset(self, g: int, dtype: np.dtype) -> int:
        """Element offset of chunk g's buffer."""
        return (g % self.depth) * (self.slot_bytes // dtype.itemsize)

    def post(self, counter: int, g: int) -> None:
        """Count chunk g on this rank's counter; the fence first publishes its data."""
        self.win.Sync()
        self.flags[self.rank][counter * _STRIDE] = g + 1

    def wait(self, counter: int, g: int) -> None:
        """Return once every rank has counted chunk g (at once for g < 0)."""
        index = counter * _STRIDE
        for j, flag in enumerate(self.flags):
            if flag[index] <= g:
                self._spin(j, counter, g)
        self.win.Sync()  # acquire: no read of the data before the counter was seen

    def _spin(self, j: int, counter: int, g: int) -> None:
        """Poll rank j's counter, yielding the core between polls after spin_seconds."""
        flag, index = self.flags[j], counter * _STRIDE
        start = time.perf_counter()
        polls = 0
        while flag[index] <= g:
            polls += 1
            if polls % 32 == 0:
                waited = time.perf_counter() - start
                if waited > self.spin_seconds:
                    os.sched_yield()
                if waited > self.stall_seconds:
                    raise RuntimeError(f"shm: rank {j} has not counted chunk {g} as "
                                       f"{_COUNTERS[counter]} after {self.stall_seconds:g} s; "
                                       "did it leave the collective?")

    def free(self) -> None:
        self.win.Unlock_all()
        self.win.Free()

