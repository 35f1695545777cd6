"""A barrier that names the ranks that did not arrive in time: torch's `monitored_barrier`
for the "collectives" backend (`ProcessGroup.monitored_barrier`).

Rank 0 waits up to the timeout for an arrival message from every other rank, then
releases them all with one message each; a rank missing at the deadline makes rank 0 raise
naming it (the first in rank order, or all of them with wait_all_ranks), and the ranks
that arrived raise when no release comes in their own timeout. Cost: 2(n - 1) messages of
8 bytes through rank 0, so 2 latencies plus rank 0's serial handling of n - 1 messages:
for debugging a hang, not for every step (the plain barrier is log2(n) steps).

Messages carry the call's sequence number on a communicator of their own, so an arrival
or release that comes after its call gave up is recognised as stale and dropped by the next
call instead of passing it. The texts are torch's (gloo's), which torch users match."""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

_ARRIVE, _RELEASE = 1, 2
_POLL_S = 0.001


class MonitoredBarrier:
    """The monitored barriers of one group, over comm (a duplicate it owns)."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.calls = 0
        self._sends: list[MPI.Request] = []  # arrivals and releases not yet known delivered

    def __call__(self, timeout_s: float, wait_all_ranks: bool = False) -> None:
        self.calls += 1
        self._sends = [r for r in self._sends if not r.Test()]
        seq = np.array([self.calls], np.int64)
        start = time.monotonic()
        if self.comm.Get_rank() == 0:
            missing = self._gather(seq, start + timeout_s)
            if missing:
                ms = round(timeout_s * 1000)
                if timeout_s <= 0:
                    raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {ms} ms")
                if wait_all_ranks:
                    names = ", ".join(str(r) for r in missing)
                    raise RuntimeError(f"Ranks {names} failed to pass monitoredBarrier in "
                                       f"{ms} ms")
                raise RuntimeError(f"Rank {missing[0]} failed to pass monitoredBarrier in "
                                   f"{ms} ms")
            for r in range(1, self.comm.Get_size()):
                self._sends.append(self.comm.Isend(seq.copy(), r, _RELEASE))
            return
        self._sends.append(self.comm.Isend(seq.copy(), 0, _ARRIVE))
        if self._receive(0, _RELEASE, seq, start + timeout_s):
            return
        me = self.comm.Get_rank()
        raise RuntimeError(f"Rank {me} successfully reached monitoredBarrier, but received "
                           f"errors while waiting for send/recv from rank 0. Please check "
                           f"rank 0 logs for the faulty rank.")

    def _gather(self, seq: np.ndarray, deadline: float) -> list[int]:
        """The ranks whose arrival of call seq has not come by deadline."""
        waiting = {r: _Receive(self.comm, r, _ARRIVE) for r in range(1, self.comm.Get_size())}
        while waiting:
            for r in [r for r, rx in waiting.items() if rx.got(seq)]:
                del waiting[r]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        for rx in waiting.values():
            rx.cancel()
        return sorted(waiting)

    def _receive(self, source: int, tag: int, seq: np.ndarray, deadline: float) -> bool:
        rx = _Receive(self.comm, source, tag)
        while not rx.got(seq):
            if time.monotonic() >= deadline:
                rx.cancel()
                return False
            time.sleep(_POLL_S)
        return True


class _Receive:
    """One posted receive of a sequence number, reposted past stale ones."""

    def __init__(self, comm: MPI.Comm, source: int, tag: int):
        self.comm, self.source, self.tag = comm, source, tag
        self.buf = np.zeros(1, np.int64)
        self.request = comm.Irecv(self.buf, source, tag)

    def got(self, seq: np.ndarray) -> bool:
        """Whether call seq's message has come (older ones are dropped on the way)."""
        while self.request.Test():
            if self.buf[0] == seq[0]:
                return True
            self.request = self.comm.Irecv(self.buf, self.source, self.tag)
        return False

    def cancel(self) -> None:
        self.request.Cancel()
        self.request.Wait()
