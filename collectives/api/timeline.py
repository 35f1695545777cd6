"""The timeline (Horovod's): every collective call of the job as one Chrome-trace JSON file,
which chrome://tracing and Perfetto open.

One row per rank (pid = job rank). Each call is an event named by its name= (else its
collective) with its agreed fields, algorithm and bytes sent as arguments, and three phases:
`queued` (an async call waiting for the ones before it; on the row's second track),
`agreement` (the exchange that checks every rank makes the same call; a small reduction
rides in it; the call's arguments name the rank that arrived last in it and how long the
others waited for it, together) and `transfer/reduce` (the data movement), then an instant `done`. With
mark_cycles, an instant `cycle` marks each call's start: the engine negotiates every call on
its own, so each call is one cycle.

The engine records in C++ (four clock reads and one entry per call, nothing when off);
start_timeline and stop_timeline are collective over the job, and at stop rank 0 gathers
every rank's events and writes the file. Ranks' clocks are aligned at the start (each
rank's zero is the end of the start call's agreement). COLLECTIVES_TIMELINE=path records
from init to shutdown (or the end of the program)."""

from __future__ import annotations

import ast
import atexit
import json
import os
from typing import Any

from collectives.api import calls
from collectives.runtime import topology
from collectives.runtime.engine import ENGINE, Job

_at_exit_registered = False


class Recording:
    """What the timeline keeps on the job's communicator: the recording under way, if any
    (its file, mark_cycles and the engine clock's origin)."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: dict[str, Any] | None = None


def _check_path(job: topology.Topology, file_path: object) -> str:
    if not isinstance(file_path, (str, os.PathLike)):
        raise TypeError(f"file_path: expected a str or path, got {type(file_path).__name__}")
    path = os.fspath(file_path)
    folder = os.path.dirname(os.path.abspath(path))
    # rank 0 writes the file: its view of the folder decides for every rank
    ok = job.comm.bcast(os.path.isdir(folder) and os.access(folder, os.W_OK)
                        if job.rank == 0 else None, root=0)
    if not ok:
        raise ValueError(f"file_path: {path!r}: rank 0 cannot write in {folder!r}")
    return path


def _start(job: topology.Topology, file_path: Any, mark_cycles: Any) -> tuple[calls.Call, Job]:
    current = job.state(Recording).current
    if current is not None:
        raise ValueError(f"file_path: a timeline is already being recorded to "
                         f"{current['path']!r}; call stop_timeline() first")
    if not isinstance(mark_cycles, bool):
        raise TypeError(f"mark_cycles: expected a bool, got {type(mark_cycles).__name__}")
    call = calls.describe(job, "start_timeline", (), "agreement")
    return call, Job(lambda: _check_path(job, file_path))


def start_timeline(file_path: str | os.PathLike, mark_cycles: bool = False) -> None:
    """Record every collective call from now on, to be written to file_path (by rank 0)
    at stop_timeline(). Collective over the job: every rank calls it."""
    global _at_exit_registered
    job = topology.get()
    with calls.Prepared(job, "start_timeline", None) as p:
        p.call, p.job = _start(job, file_path, mark_cycles)
    path = p.run()
    job.state(Recording).current = {"path": path, "mark_cycles": mark_cycles,
                                    "origin": ENGINE.native.start_trace()}
    if not _at_exit_registered:  # the file is written even if stop_timeline() never is
        atexit.register(_stop_at_exit)
        _at_exit_registered = True


def _stop(job: topology.Topology) -> tuple[calls.Call, Job]:
    call = calls.describe(job, "stop_timeline", (), "agreement")

    def move() -> None:
        state = job.state(Recording).current
        taken = ENGINE.native.take_trace()
        if state is None:  # on every rank alike: start and stop are collective
            return
        mine = _events(job.rank, taken, state["origin"],
                       state["mark_cycles"])
        everyone = job.comm.gather(mine, root=0)
        if job.rank == 0:
            with open(state["path"], "w") as f:
                json.dump({"traceEvents": [e for events in everyone for e in events],
                           "displayTimeUnit": "ms"}, f)

    return call, Job(move)


def stop_timeline() -> None:
    """Stop recording and write the file (rank 0). Collective over the job; a no-op
    everywhere when no timeline is being recorded."""
    job = topology.get()
    try:
        with calls.Prepared(job, "stop_timeline", None) as p:
            p.call, p.job = _stop(job)
        p.run()
    finally:
        job.state(Recording).current = None


def active() -> bool:
    """Whether the job records a timeline (False before init)."""
    return topology.initialized() and topology.get().state(Recording).current is not None


def _stop_at_exit() -> None:
    if active():
        stop_timeline()


def _fields(detail: str) -> dict:
    try:
        return ast.literal_eval(detail)
    except (ValueError, SyntaxError):
        return {}


def _events(rank: int, raw: list[tuple], origin: float, mark_cycles: bool) -> list[dict]:
    """One rank's Chrome-trace events (times in microseconds since origin)."""
    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    out = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
           {"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "calls"}},
           {"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "queue"}}]
    for (collective, detail, algorithm, queued, start, agreed, moved, end, nbytes, last,
         waited) in raw:
        fields = _fields(detail)
        label = fields.get("name") or collective
        args = {**{k: str(v) for k, v in fields.items()}, "collective": collective,
                "algorithm": algorithm, "bytes": nbytes}  # the algorithm that ran
        if last >= 0:  # who the others waited for in the agreement, and how long together
            args.update(last_to_arrive=last, others_waited_ms=round(waited * 1e3, 3))

        def span(name: str, t0: float, t1: float, tid: int = 0, **extra: Any) -> dict:
            return {"name": name, "ph": "X", "pid": rank, "tid": tid, "ts": us(t0),
                    "dur": max(0.0, round(us(t1) - us(t0), 3)), **extra}

        if queued >= 0:
            out.append(span("queued", queued, start, tid=1, args={"call": label}))
        out.append(span(label, start, end, cat=collective, args=args))
        out.append(span("agreement", start, agreed))
        if moved > agreed:
            out.append(span("transfer/reduce", agreed, moved))
        out.append({"name": "done", "ph": "i", "s": "t", "pid": rank, "tid": 0, "ts": us(end)})
        if mark_cycles:
            out.append({"name": "cycle", "ph": "i", "s": "p", "pid": rank, "tid": 0,
                        "ts": us(start)})
    return out
