"""Calls and bytes per (collective, algorithm), per communicator.

The counters live in C++ (`_C.Stats`, one per communicator, csrc/runtime/engine.h) and the
engine alone writes them: each finished call counts once, with the bytes our own messages
moved while it ran (point-to-point messages and agreement payloads; one call runs at a
time, so the attribution is exact). The MPI library's collectives (`mpi`) and the shared
window's copies (`shm`) send no messages of ours: they count the payload this rank
contributes and receives (allreduce: the buffer both ways; allgather: its rows out, the
others' in; reducescatter: the others' blocks out, its block in; broadcast: the buffer out
on the root, in elsewhere)."""

from __future__ import annotations

from typing import Any

from collectives.api import process_sets


def stats(comm: Any = None, process_set: Any = None) -> dict:
    """{"bytes_sent", "bytes_received", "calls", "per_op": {"allreduce/ring": {...}},
    "waited_for": {rank: seconds}} of the job's communicator, or of comm (an mpi4py
    communicator used in collectives), or of process_set. waited_for: the seconds the other
    ranks spent waiting for each rank (numbered in that communicator) since it was made,
    together (runtime/stragglers.py), ranks never waited for left out; the same on every
    rank."""
    per_op, totals = {}, {"bytes_sent": 0, "bytes_received": 0, "calls": 0}
    native = process_sets.resolve(comm, process_set).stats
    counters = native.snapshot()
    for collective, algorithm, calls, sent, received in counters:
        per_op[f"{collective}/{algorithm}"] = {"bytes_sent": sent, "bytes_received": received,
                                               "calls": calls}
        totals["bytes_sent"] += sent
        totals["bytes_received"] += received
        totals["calls"] += calls
    waited_for = {r: s for r, s in enumerate(native.waits()) if s > 0}
    return dict(totals, per_op=per_op, waited_for=waited_for)

