"""Fault-tolerant mode: a rank that dies becomes one exception on every survivor.

When `Config.fault_tolerant` is on (by default when the job runs under `mpirun --with-ft
ulfm`, Open MPI's fault-tolerance extension), a collective that cannot finish because ranks
died raises RanksFailedError naming them, on every surviving rank, instead of hanging or
ending the job; collectives.elastic then shrinks the job and goes on. Outside that mode a
failure ends the job as before (MPI's default, and the abort of an uncaught exception).

How a failure reaches every survivor:
- Ranks blocked in MPI learn of it from MPI itself (our communicators return errors, as
  mpi4py sets them to): the MPI error, or a C++ call's error text naming it.
- Ranks waiting on a shared window's counters call no MPI: each long wait checks every
  5 ms that the rank it waits for is alive and that no rank of the window flagged a failure
  (csrc/runtime/shm_sync.h), and raises PeerFailure.
- The first rank to see a failure revokes the communicator (MPI_Comm_revoke: every rank
  blocked in it returns) and flags every shared window it holds (runtime/window.py), so
  ranks waiting for it, rather than for the dead rank, stop too.
The failed ranks are the ones MPI reports failed on the communicator (MPI_Comm_get_failed),
asked for up to FIND_S after the failure is seen, or, sooner, those whose process on this
host is gone; once one is named, SETTLE_S more for ranks that died with it. The Topology
then remembers them: every later call on it raises at once, until collectives.elastic
replaces it."""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any, NoReturn, Protocol, TypeVar

from mpi4py import MPI

from collectives.kernels import _C
from collectives.runtime import flight, window

S = TypeVar("S")


class Topology(Protocol):
    """What this module reads of a communicator (runtime/topology.py's Topology, which
    imports this module)."""

    comm: MPI.Comm
    config: Any  # config.Config: fault_tolerant
    processes: list[tuple[str, int]]  # each rank's (host, pid)
    stats: Any  # _C.Stats: its label names the communicator in the flight record

    def comms(self) -> list[MPI.Comm]: ...

    def state(self, kind: type[S]) -> S: ...


class Failures:
    """What this module keeps per communicator: the ranks it lost, once seen (None before)."""

    __slots__ = ("lost",)

    def __init__(self) -> None:
        self.lost: list[int] | None = None


def failed(topo: Topology) -> list[int] | None:
    """The ranks topo lost, once a call on it saw them fail (None: none seen)."""
    return topo.state(Failures).lost

#: Seconds a rank that has seen a failure waits for MPI to name the failed ranks.
FIND_S = 1.0
#: Seconds it goes on looking once one is named, for ranks that died with it.
SETTLE_S = 0.05

#: A wait on a shared window found its peer dead, or flagged by a peer (raised by C++).
PeerFailure = _C.PeerFailure


class RanksFailedError(_C.StallError):
    """Ranks of the communicator died: this call, and every later call on that communicator,
    cannot finish. `ranks`: the failed ranks (numbered in that communicator; empty if MPI
    had not named them yet). Raised on every surviving rank; collectives.elastic.run
    catches it, restores the last commit and shrinks the job to the survivors. A kind of
    StallError (a collective that cannot complete), so Horovod's HorovodInternalError,
    which is StallError, catches it too."""

    def __init__(self, ranks: list[int], cause: str = ""):
        self.ranks = list(ranks)
        named = f"ranks {self.ranks}" if self.ranks else "ranks (not named by MPI yet)"
        super().__init__(f"{named} of the communicator failed"
                         + (f" ({cause})" if cause else "")
                         + "; collectives.elastic.run shrinks the job to the survivors")


def _looks_failed(exc: BaseException) -> bool:
    """Whether exc may come from a failed rank: an MPI error (ULFM may report a failure
    as any error class, MPI_ERR_OTHER included), our C++ layer's text of one, or a shared
    window's PeerFailure."""
    if isinstance(exc, (PeerFailure, MPI.Exception)):
        return True
    return type(exc) is RuntimeError and "MPI_ERR" in str(exc)


def _failed_ranks(comm: MPI.Comm) -> list[int]:
    """The ranks of comm that MPI knows failed (local, no communication)."""
    try:
        failed = comm.Get_failed()
    except MPI.Exception:
        return []
    try:
        if failed.Get_size() == 0:
            return []
        group = comm.Get_group()
        ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), group)
        group.Free()
        return sorted(r for r in ranks if r != MPI.UNDEFINED)
    finally:
        failed.Free()


def failure(topo: Topology, exc: BaseException) -> RanksFailedError | None:
    """The RanksFailedError that exc, raised by a call on topo, stands for (None: it is not
    a failure, or the job is not fault-tolerant). The first time: flag this rank's shared
    windows, revoke topo's communicators and wait up to FIND_S for MPI to name the failed
    ranks, which topo keeps."""
    seen = topo.state(Failures)
    if seen.lost is None:
        if not topo.config.fault_tolerant or not _looks_failed(exc):
            return None
        window.mark_failed()
        for comm in topo.comms():
            try:
                comm.Revoke()
            except MPI.Exception:
                pass  # revoked already, or freed
        deadline = time.monotonic() + FIND_S
        while not (ranks := _named(topo)) and time.monotonic() < deadline:
            time.sleep(0.001)
        settled = time.monotonic() + SETTLE_S  # ranks that die together are named together
        while ranks and time.monotonic() < settled:
            time.sleep(0.005)
            ranks = sorted(set(ranks) | set(_named(topo)))
        seen.lost = ranks
        _fence(topo, ranks)
        flight.dump(f"ranks {ranks} of {topo.stats.label} failed")
    return RanksFailedError(seen.lost, str(exc).splitlines()[0] if str(exc) else "")


def _named(topo: Topology) -> list[int]:
    """The failed ranks known now: MPI's, and those whose process on this host is gone."""
    return sorted(set(_failed_ranks(topo.comm)) | set(_dead_here(topo)))


def _dead_here(topo: Topology) -> list[int]:
    """The ranks of topo whose process on this host is gone: named at once, where MPI's
    own notice of a death arrives only after its detector's delays (benchmarks/README.md,
    Elastic training, compares the two)."""
    here = socket.gethostname()
    return [r for r, (host, pid) in enumerate(topo.processes)
            if host == here and not _C.process_alive(pid)]


def _fence(topo: Topology, ranks: list[int]) -> None:
    """Kill the failed ranks' processes that still run on this host (a hung rank that MPI's
    detector declared failed), so none comes back into a job that has left it."""
    here = socket.gethostname()
    for r in ranks:
        host, pid = topo.processes[r]
        if host == here and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def reraise(topo: Topology, exc: BaseException) -> NoReturn:
    """Raise what exc, from a call on topo, stands for: RanksFailedError (from exc) for a
    failure in fault-tolerant mode, else exc itself."""
    failed = failure(topo, exc)
    if failed is None:
        raise exc
    raise failed from exc


def check(topo: Topology) -> None:
    """Raise RanksFailedError if topo has lost ranks (every call after the first to see it)."""
    ranks = topo.state(Failures).lost
    if ranks is not None:
        raise RanksFailedError(ranks, "seen by an earlier call")


#: agree's word: one bit per rank (rank % 31), in a C int's 31 non-sign bits
_WORD_BITS = 31


def agree(topo: Topology, ok: bool) -> list[int]:
    """The ranks of topo that passed ok=False, the same list on every survivor ([]: every
    rank passed ok=True), by ULFM's MPI_Comm_agree, which works on a revoked communicator
    too: if ranks died, every survivor raises RanksFailedError, whether or not its own last
    call saw them. For a step that must take effect on every rank or on none (an elastic
    commit). The agreement ANDs one word in which a failing rank clears bit rank % 31, so
    beyond 31 ranks the list holds every rank that shares a failing rank's bit."""
    comm = topo.comm
    mine = (1 << _WORD_BITS) - 1
    if not ok:
        mine &= ~(1 << comm.Get_rank() % _WORD_BITS)
    try:
        word = comm.Agree(mine)
    except MPI.Exception as exc:
        reraise(topo, exc)
    return [r for r in range(comm.Get_size()) if not word >> (r % _WORD_BITS) & 1]
