"""Stall inspection: a collective that waits too long says who is missing, then fails.

Every rank keeps a small record of what it is doing (call number, collective, arguments,
since when; kept by the engine in C++), and a responder thread answers status requests
about it on a private communicator, polling every 50 ms, so even a rank busy in user code
answers. A rank whose
agreement step has waited longer than COLLECTIVES_STALL_WARNING_S asks every other rank
for its record and logs which ranks have not joined and what they are doing; after
its communicator's timeout (COLLECTIVES_STALL_TIMEOUT_S, default 1800 s, or a torch process
group's `timeout`) it writes its flight record (flight.py) and raises StallError. The
responder thread also reads SIGUSR1 for the flight recorder and ticks rank 0's straggler
watch. MPI cannot cancel a collective, so after a
StallError the library refuses further calls."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import math
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from mpi4py import MPI

from collectives import config
from collectives.kernels import _C
from collectives.runtime import flight, window
from collectives.runtime.engine import ENGINE

log = logging.getLogger("collectives")

TAG_ASK, TAG_ANSWER = 41, 42

#: A collective waited longer than COLLECTIVES_STALL_TIMEOUT_S for other ranks (and every
#: later call, since MPI cannot cancel the stalled one). Raised from C++ too.
StallError = _C.StallError


def describe(snapshot: tuple) -> str:
    """One rank's record (engine snapshot: state, calls, collective, detail, age) as text."""
    state, calls, collective, detail, age = snapshot
    what = f"{collective} #{calls} {detail}"
    if state == "idle":
        return (f"outside collectives for {age:.1f} s (last: {what})" if calls
                else f"has made no collective call yet ({age:.1f} s)")
    return f"{state} {age:.1f} s in {what}"


def timed_out(what: str, waited: float, whom: str, timeout_s: float) -> str:
    """Why a wait ended in StallError, in the words torch users match ("Timed out")."""
    return f"{what}: Timed out waiting {waited * 1000:.0f}ms for {whom} (timeout {timeout_s:g} s)"


@contextlib.contextmanager
def bounded(seconds: float | None, what: str) -> Iterator[None]:
    """Within the block, MPI steps that have not returned after `seconds` end the job with
    a message naming `what`: the caller is then stuck inside MPI, where nothing else can
    reach it, so a timer thread calls MPI_Abort. None: unbounded."""
    if seconds is None:
        yield
        return

    def stuck() -> None:
        print(f"collectives: {what} has not finished in {seconds:g} s: MPI is stuck; "
              f"ending the job", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)

    timer = threading.Timer(seconds, stuck)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


#: A bounded wait (wait_all) polls back to back for SPIN_S, then yields the GIL between
#: polls, then after YIELD_S sleeps POLL_S between them.
SPIN_S = 1e-3
YIELD_S = 0.1
POLL_S = 1e-4


def wait_all(comm: MPI.Comm, requests: list[MPI.Request], what: str) -> None:
    """MPI.Request.Waitall, bounded by comm's stall timeout (its Topology's limit as it is
    now, or COLLECTIVES_STALL_TIMEOUT_S on a communicator no Topology runs on): past it the
    engine is marked failed, the flight record written and StallError raised, as for a
    wait in the agreement. For the data phases, which wait on MPI requests of their own.
    The requests are left pending: MPI cannot cancel them, and the library refuses every
    later call."""
    test = MPI.Request.Testall
    if test(requests):
        return
    start = time.monotonic()
    while time.monotonic() - start < SPIN_S:  # as MPI_Waitall would spin
        if test(requests):
            return
    limit = limit_of(comm)
    timeout_s = config.get().stall_timeout_s if limit is None else limit.timeout_s
    if timeout_s is None:
        MPI.Request.Waitall(requests)
        return
    while not test(requests):
        waited = time.monotonic() - start
        if waited >= timeout_s:
            why = timed_out(what, waited, "other ranks", timeout_s)
            ENGINE.native.fail(why)
            flight.dump(why)
            raise StallError(f"{why}\n{flight.where('this rank')}")
        time.sleep(0 if waited < YIELD_S else POLL_S)


class Limit:
    """One communicator's stall timeout in seconds (None: wait forever), owned by its
    Topology: the waits of its agreement read it through on_wait, the meet reads it, and
    the shared-memory windows made on its communicator read `native` (a _C.StallLimit) as
    each wait starts, so a timeout set later (Topology.set_timeout, torch's timeout=)
    reaches every wait. attach() ties it to a communicator; limit_of() finds it there."""

    __slots__ = ("_timeout_s", "native")

    def __init__(self, timeout_s: float | None):
        self.native = _C.StallLimit()
        self.timeout_s = timeout_s

    @property
    def timeout_s(self) -> float | None:
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float | None) -> None:
        self._timeout_s = seconds
        self.native.seconds = math.inf if seconds is None else seconds

    def attach(self, comm: MPI.Comm) -> None:
        """Let the code that runs on comm find this limit (an MPI attribute: it goes with
        comm, and MPI reuses no handle while comm lives)."""
        comm.Set_attr(_limit_key(), self)


@functools.cache  # created on first use: MPI must be initialized
def _limit_key() -> int:
    return MPI.Comm.Create_keyval()


def limit_of(comm: MPI.Comm) -> Limit | None:
    """The Limit attached to comm (its Topology's), or None for a communicator no
    Topology runs on."""
    return comm.Get_attr(_limit_key())


class Watchdog:
    def __init__(self, comm: MPI.Comm, warn_s: float):
        self.comm = comm.Dup()  # status traffic never mixes with data
        self.warn_s = warn_s
        self._stop = threading.Event()
        self._asked = 0
        #: rank 0's straggler watch (stragglers.py), ticked by the thread; None elsewhere
        self.stragglers: Any = None
        self._thread = threading.Thread(target=self._respond, name="collectives-watchdog",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # before mpi4py finalizes MPI (atexit runs LIFO)

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()

    def _respond(self) -> None:
        buf = bytearray(16)
        req = self.comm.Irecv(buf, MPI.ANY_SOURCE, TAG_ASK)
        status = MPI.Status()
        try:
            while not self._stop.wait(0.05):
                flight.poll_signal()
                if self.stragglers is not None:
                    self.stragglers.tick()
                while req.Test(status):
                    asker, ask_id = status.Get_source(), bytes(buf[:8])
                    self.comm.send((ask_id, ENGINE.native.snapshot()), asker, TAG_ANSWER)
                    req = self.comm.Irecv(buf, MPI.ANY_SOURCE, TAG_ASK)
        except MPI.Exception:
            # a rank failed (fault-tolerant mode), seen here first when this rank is not in
            # MPI (waiting on a shared window, or a stopped rank that MPI's detector declared
            # dead): flag the windows so those waits raise; the job's rebuild makes a new one
            window.mark_failed()
            return
        req.Cancel()
        req.Wait()

    def survey(self, timeout: float = 2.0) -> dict[int, tuple | None]:
        """Every other rank's record snapshot (None: it did not answer in time)."""
        self._asked += 1
        ask_id = self._asked.to_bytes(8, "little")
        me, n = self.comm.Get_rank(), self.comm.Get_size()
        for r in range(n):
            if r != me:
                self.comm.Send(ask_id + bytes(8), r, TAG_ASK)
        answers: dict[int, tuple | None] = {}
        deadline = time.monotonic() + timeout
        status = MPI.Status()
        while len(answers) < n - 1 and time.monotonic() < deadline:
            if self.comm.Iprobe(MPI.ANY_SOURCE, TAG_ANSWER, status):
                got_id, snap = self.comm.recv(source=status.Get_source(), tag=TAG_ANSWER)
                if got_id == ask_id:
                    answers[status.Get_source()] = snap
            else:
                time.sleep(0.005)
        return {r: answers.get(r) for r in range(n) if r != me}

    def first_deadline(self, limit: Limit) -> float:
        """Seconds of waiting after which on_wait is first due."""
        timeout_s = limit.timeout_s
        return self.warn_s if timeout_s is None else min(self.warn_s, timeout_s)

    def on_wait(self, limit: Limit, waited: float) -> float:
        """Called by a waiting agreement step (csrc/runtime/agree.cpp) at each deadline: logs
        who is missing, or past the communicator's limit marks the engine failed and raises
        StallError (its text says "Timed out", as torch's backends do); returns the next
        deadline."""
        warn_s, timeout_s = self.warn_s, limit.timeout_s
        if timeout_s is not None and waited >= timeout_s:
            _, calls, collective, _, _ = ENGINE.native.snapshot()
            why = timed_out(f"{collective} #{calls}", waited, "other ranks", timeout_s)
            ENGINE.native.fail(why)
            report, survey = self._report(waited)
            flight.dump(why, survey)
            raise StallError(f"{why}\n{report}\n{flight.where('this rank and any other that timed out')}")
        log.warning(self._report(waited)[0])
        next_warning = (int(waited / warn_s) + 1) * warn_s
        return next_warning if timeout_s is None else min(next_warning, timeout_s)

    def _report(self, waited: float) -> tuple[str, dict[int, str]]:
        """The stall's text, and what each other rank said (rank -> text)."""
        me = self.comm.Get_rank()
        _, calls, collective, detail, _ = ENGINE.native.snapshot()
        others = self.survey()
        missing = [r for r, s in others.items()
                   if s is None or s[0] == "idle" or s[1] != calls]
        lines = [f"collectives stall: rank {me} has waited {waited:.1f} s in "
                 f"{collective} #{calls} {detail}; not joined: ranks {missing}"]
        survey = {r: describe(snap) if snap else "did not answer (dead or not progressing)"
                  for r, snap in sorted(others.items())}
        lines += [f"  rank {r}: {text}" for r, text in survey.items()]
        return "\n".join(lines), survey
