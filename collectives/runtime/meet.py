"""Ranks meet beside the engine: a barrier that is not held up by this rank's queued
collectives (Horovod's barrier, collectives/horovod/, which then waits for the ones every
rank has started).

The library's own barrier is a collective like the others: agreed, in submission order,
after everything submitted before it. Horovod's is not: its ranks meet while async calls
are outstanding, even calls the other ranks make only after the barrier (rank 0 starts an
allreduce, meets rank 1, which then starts its side of it). So this one runs on the
caller's thread, while the engine's thread may be waiting inside such a call.

How: a dissemination barrier, ceil(log2 n) rounds; in round k every rank sends the least
value it has seen to rank + 2^k and receives one from rank - 2^k, on a tag of its own
(messages of one pair and tag arrive in order, so one barrier's never satisfies the
next's); after the last round every rank has heard from every other, so it holds the least
value of all (Horovod's barrier agrees on how many async calls every rank has started).
Cost: ceil(log2 n) message latencies of 8 bytes. The engine's thread may be in MPI
meanwhile, so this takes MPI_THREAD_MULTIPLE. It waits as the agreement does: a warning
naming the missing rank at the stall warning, StallError at the stall timeout (and the
library refuses later calls: MPI cannot cancel the messages)."""

from __future__ import annotations

import logging
import time

import numpy as np
from mpi4py import MPI

from collectives.runtime.engine import ENGINE
from collectives.runtime.topology import Topology
from collectives.runtime.watchdog import StallError, timed_out

log = logging.getLogger("collectives")

TAG_MEET = 71
#: Longest sleep between polls of a round's messages (a barrier's latency when a rank is
#: late; the first polls spin).
POLL_S = 1e-3


def available() -> bool:
    """Whether ranks can meet beside the engine (MPI_THREAD_MULTIPLE)."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def meet(topo: Topology, value: int) -> int:
    """Return once every rank of topo has called meet(topo, ...): the least of their values."""
    if not available():
        raise RuntimeError("meet: needs MPI_THREAD_MULTIPLE (mpi4py's default thread level)")
    comm, n, r = topo.comm, topo.size, topo.rank
    least, theirs = np.array([value], np.int64), np.empty(1, np.int64)
    config = topo.config
    start, warn_at = time.monotonic(), config.stall_warning_s
    step = 1
    while step < n:
        src = (r - step) % n
        requests = [comm.Irecv(theirs, source=src, tag=TAG_MEET),
                    comm.Isend(least, dest=(r + step) % n, tag=TAG_MEET)]
        polls = 0
        while not MPI.Request.Testall(requests):
            waited = time.monotonic() - start
            timeout_s = topo.limit.timeout_s
            if timeout_s is not None and waited >= timeout_s:
                why = timed_out("barrier", waited, f"rank {src}", timeout_s)
                ENGINE.native.fail(why)
                raise StallError(why)
            if waited >= warn_at:
                log.warning("collectives stall: rank %d has waited %.1f s in a barrier for "
                            "rank %d", r, waited, src)
                warn_at += config.stall_warning_s
            polls += 1
            time.sleep(0 if polls < 100 else POLL_S)
        least[0] = min(least[0], theirs[0])
        step *= 2
    return int(least[0])
