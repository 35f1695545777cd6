"""Counters of calls and bytes moved by our own algorithms.

Bytes are counted at the point-to-point layer, so they are exact for ring, tree and the
other algorithms we implement; for `mpi` (the MPI library's own collectives) the library's
internal traffic is invisible and only calls are counted."""

from __future__ import annotations

import collections
import threading

_lock = threading.Lock()
_totals = {"bytes_sent": 0, "bytes_received": 0, "calls": 0}
_per = collections.defaultdict(lambda: {"bytes_sent": 0, "bytes_received": 0, "calls": 0})


def add_bytes(sent: int, received: int) -> None:
    with _lock:
        _totals["bytes_sent"] += sent
        _totals["bytes_received"] += received


def snapshot() -> tuple[int, int]:
    with _lock:
        return _totals["bytes_sent"], _totals["bytes_received"]


def record_call(collective: str, algorithm: str, sent: int, received: int) -> None:
    """Attribute one finished call and the bytes it moved to (collective, algorithm)."""
    with _lock:
        _totals["calls"] += 1
        entry = _per[f"{collective}/{algorithm}"]
        entry["calls"] += 1
        entry["bytes_sent"] += sent
        entry["bytes_received"] += received


def stats() -> dict:
    """{"bytes_sent", "bytes_received", "calls", "per_op": {"allreduce/ring": {...}}}."""
    with _lock:
        return dict(_totals, per_op={k: dict(v) for k, v in sorted(_per.items())})


def reset() -> None:
    with _lock:
        for k in _totals:
            _totals[k] = 0
        _per.clear()
