"""The flight recorder's files: each rank's last calls, written where a person (or
`python -m collectives.debug`) reads them after a hang, a mismatch or a failure.

The engine keeps the record (csrc/runtime/engine.h, Record): a ring of the last
`flight_recorder` calls (COLLECTIVES_FLIGHT_RECORDER, default 1024), each with its number
on this rank and on its communicator, the communicator's label, the collective, its agreed
arguments and algorithm, when it was queued, entered, agreed and ended, its bytes, how it
ended, and which rank the others waited for and how long. The current call is the ring's
newest entry, so the ring costs what the stall record cost before it: a few string
assignments per call into storage the entry's previous call left.

dump() writes the ring as DIR/rank<R>.json (R: the job rank; a later dump replaces it) with
the rank's state now, what the watchdog learnt from the other ranks if it asked, and the
seconds the others waited for each rank. It is called where the errors are raised
(StallError: watchdog.py; MismatchError: agreement.py; RanksFailedError: faults.py), from
the watchdog's thread on SIGUSR1 (so a rank stuck inside MPI still writes), and by
collectives.dump_flight_recorder(). A stopped or dead rank writes nothing: the analyzer
works from the others' files.

DIR is COLLECTIVES_DUMP_DIR, else collectives-<job> in the system's temporary folder, <job>
agreed at init (rank 0's start time and pid), so a job's ranks write into one folder and
two jobs never mix. Times in a file are on the job's clock: seconds since rank 0 started it
at init, read on every host with that host's offset from rank 0's clock (_origin)."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import tempfile
import threading
import time
from typing import Any

from mpi4py import MPI

from collectives import config as _config

log = logging.getLogger("collectives")

#: The files' format, for the analyzer.
FORMAT = "collectives-flight-1"

#: The tag of the clock's round trips (the job's private duplicate carries no other p2p
#: traffic at init).
TAG_CLOCK = 43

#: The signal that makes every rank that receives it write its record.
SIGNAL = signal.SIGUSR1


class _Job:
    """What dump() needs of the job: set by start() at init (and at each rebuild)."""

    def __init__(self, engine: Any, rank: int, size: int, folder: str, origin: float,
                 stats: Any):
        self.engine = engine  # the _C.Engine that keeps the record
        self.rank, self.size, self.folder = rank, size, folder
        self.origin = origin  # the steady clock's reading at the job clock's zero
        self.stats = stats    # the job communicator's _C.Stats (waited_for)


_job: _Job | None = None
_wakeup: int | None = None  # read end of the pipe Python's signal handler writes to
_lock = threading.Lock()    # dumps from the watchdog's thread and the caller's


def start(engine: Any, comm: MPI.Comm, stats: Any) -> None:
    """Collective over the job's comm: mark the job clock's zero on every rank (_origin),
    agree on the dump folder, size the engine's ring (config.flight_recorder) and
    watch SIGUSR1. engine: the _C.Engine; stats: the job communicator's counters. (The
    engine's module imports this layer's fault handling, which dumps: it is passed in.)"""
    global _job
    cfg = _config.get()
    if not isinstance(cfg.flight_recorder, int) or cfg.flight_recorder < 0:
        raise ValueError(f"COLLECTIVES_FLIGHT_RECORDER: expected calls >= 0, got "
                         f"{cfg.flight_recorder!r}")
    tag = comm.bcast(f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
                     if comm.Get_rank() == 0 else None, root=0)
    origin = _origin(engine, comm)
    engine.set_origin(origin)
    if engine.flight_capacity != max(cfg.flight_recorder, 1):
        engine.flight_capacity = cfg.flight_recorder
    folder = cfg.dump_dir or os.path.join(tempfile.gettempdir(), f"collectives-{tag}")
    _job = _Job(engine, comm.Get_rank(), comm.Get_size(), folder, origin, stats)
    _watch_signal()


#: Round trips with rank 0 over which a host's clock offset is measured (the fastest counts).
ROUND_TRIPS = 8


def _origin(engine: Any, comm: MPI.Comm) -> float:
    """This rank's steady-clock reading at rank 0's, when rank 0 started the job clock
    (collective). Ranks on one host read one clock (CLOCK_MONOTONIC): rank 0's host starts
    at rank 0's reading, the others' hosts at it plus their clock's offset, which their
    lowest rank measures in ROUND_TRIPS round trips with rank 0 (the offset taken at the
    fastest one's midpoint: off by at most half that round trip, a few microseconds on one
    switch). A barrier's exit would leave each rank off by the barrier's skew instead, and
    the agreement would credit that skew to a rank in every call."""
    rank = comm.Get_rank()
    hosts = comm.allgather(socket.gethostname())
    leaders = {host: hosts.index(host) for host in hosts}
    zero = engine.clock() if rank == 0 else None
    offsets = {}
    if rank == 0:
        for leader in sorted(set(leaders.values()) - {0}):
            best = (math.inf, 0.0)
            for _ in range(ROUND_TRIPS):
                sent = engine.clock()
                theirs = comm.sendrecv(None, leader, TAG_CLOCK, source=leader, recvtag=TAG_CLOCK)
                back = engine.clock()
                best = min(best, (back - sent, theirs - (sent + back) / 2))
            offsets[hosts[leader]] = best[1]
    elif leaders[hosts[rank]] == rank:
        for _ in range(ROUND_TRIPS):
            comm.recv(source=0, tag=TAG_CLOCK)
            comm.send(engine.clock(), 0, TAG_CLOCK)
    zero, offsets = comm.bcast((zero, offsets), root=0)
    return zero + offsets.get(hosts[rank], 0.0)


def folder() -> str | None:
    """Where this job's dumps go (None before init)."""
    return None if _job is None else _job.folder


def _watch_signal() -> None:
    """Make SIGUSR1 ask for a dump, unless the program handles it already. Python runs a
    signal's handler in the main thread only when that thread runs Python code, which a
    rank stuck in a collective does not; so Python's own C handler also writes the signal's
    number to a pipe (signal.set_wakeup_fd) that the watchdog's thread reads (poll_signal).
    Where the program already has a wakeup fd, the handler dumps when it runs."""
    global _wakeup
    if _wakeup is not None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(SIGNAL) not in (signal.SIG_DFL, None):
        return
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if previous != -1:  # the program reads signals itself (asyncio): leave it that
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        signal.signal(SIGNAL, lambda _signum, _frame: dump(f"signal {SIGNAL.name}"))
        return
    _wakeup = read
    signal.signal(SIGNAL, lambda _signum, _frame: None)  # the watchdog's thread dumps


def poll_signal() -> None:
    """Dump if SIGUSR1 arrived since the last poll (the watchdog's thread, every 50 ms)."""
    if _wakeup is None:
        return
    try:
        got = os.read(_wakeup, 512)
    except BlockingIOError:
        return
    if SIGNAL in got:
        dump(f"signal {SIGNAL.name}")


def record(job: _Job) -> dict[str, Any]:
    """This rank's record now: its state, its kept calls (oldest first) and the seconds the
    other ranks waited for each rank of the job."""
    origin = job.origin

    def at(t: float) -> float | None:
        return None if t <= 0 else round(t - origin, 6)

    calls = []
    for (seq, comm, comm_seq, collective, detail, algorithm, queued, start_, agreed, end,
         nbytes, last, waited, phase) in job.engine.history():
        calls.append({"seq": seq, "comm": comm, "comm_seq": comm_seq,
                      "collective": collective, "detail": detail, "algorithm": algorithm,
                      "queued": at(queued), "start": at(start_), "agreed": at(agreed),
                      "end": at(end), "bytes": nbytes, "last": last,
                      "waited": round(waited, 6), "phase": phase})
    state, ncalls, collective, detail, age = job.engine.snapshot()
    waits = job.stats.waits()
    return {"state": {"state": state, "calls": ncalls, "collective": collective,
                      "detail": detail, "age": round(age, 6)},
            "calls": calls,
            "waited_for": {str(r): round(s, 6) for r, s in enumerate(waits) if s > 0}}


def write(reason: str, survey: dict[int, str] | None = None) -> str:
    """Write this rank's record to the job's folder as rank<R>.json, with reason and, where
    the watchdog asked the others, what each said (survey: rank -> text); returns the path.
    Raises RuntimeError before init, OSError where the file cannot be written."""
    job = _job
    if job is None:
        raise RuntimeError("the flight recorder starts at init: call collectives.init() first")
    content = {"format": FORMAT, "rank": job.rank, "size": job.size,
               "host": socket.gethostname(), "pid": os.getpid(), "reason": reason,
               "time": time.time(), "clock": round(job.engine.clock() - job.origin, 6),
               **record(job),
               "survey": {str(r): text for r, text in (survey or {}).items()}}
    path = os.path.join(job.folder, f"rank{job.rank}.json")
    with _lock:
        os.makedirs(job.folder, exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as f:
            json.dump(content, f)
        os.replace(partial, path)  # a reader never sees half a file
    log.warning("collectives: rank %d wrote its flight record (%s) to %s",
                job.rank, reason, path)
    return path


def dump(reason: str, survey: dict[int, str] | None = None) -> str | None:
    """write(), where an error is on its way: None instead of raising (before init, or
    a file that cannot be written, which is logged), so a dump never hides the error."""
    if _job is None:
        return None
    try:
        return write(reason, survey)
    except OSError as exc:
        log.warning("collectives: could not write the flight record to %s: %s",
                    _job.folder, exc)
        return None


def where(reason: str) -> str:
    """The sentence an error adds about the dumps: where they are and how to read them."""
    return (f"flight records ({reason}) in {folder()}: "
            f"python -m collectives.debug {folder()}")
