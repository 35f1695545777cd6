"""Counters of calls and bytes moved by our own algorithms.

Bytes are counted at the point-to-point layer, so they are exact for ring, tree and the
other algorithms we implement; for `mpi` (the MPI library's own collectives) the library's
internal traffic is invisible and only calls are counted."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_totals = {"bytes_sent": 0, "bytes_received": 0, "calls": 0}
_per: dict[tuple[str, str], list[int]] = {}  # (collective, algorithm) -> [calls, sent, received]


def add_bytes(sent: int, received: int) -> None:
    with _lock:
        _totals["bytes_sent"] += sent
        _totals["bytes_received"] += received


def snapshot() -> tuple[int, int]:
    with _lock:
        return _totals["bytes_sent"], _totals["bytes_received"]


def counter(collective: str, algorithm: str) -> list[int]:
    """The [calls, sent, received] counter of (collective, algorithm), for count()."""
    with _lock:
        return _per.setdefault((collective, algorithm), [0, 0, 0])


def count(entry: list[int], sent: int, received: int, counted: bool = False) -> None:
    """One finished call moving these bytes, on a counter; counted: the bytes are already
    in the totals (add_bytes)."""
    with _lock:
        if not counted:
            _totals["bytes_sent"] += sent
            _totals["bytes_received"] += received
        _totals["calls"] += 1
        entry[0] += 1
        entry[1] += sent
        entry[2] += received


def record_call(collective: str, algorithm: str, sent: int, received: int,
                add: bool = False) -> None:
    """Attribute one finished call and the bytes it moved to (collective, algorithm); with
    add=True the bytes are also added to the totals (not yet counted by add_bytes)."""
    with _lock:
        if add:
            _totals["bytes_sent"] += sent
            _totals["bytes_received"] += received
        _totals["calls"] += 1
        entry = _per.setdefault((collective, algorithm), [0, 0, 0])
        entry[0] += 1
        entry[1] += sent
        entry[2] += received


def stats() -> dict:
    """{"bytes_sent", "bytes_received", "calls", "per_op": {"allreduce/ring": {...}}}."""
    with _lock:
        per_op = {f"{c}/{a}": {"bytes_sent": v[1], "bytes_received": v[2], "calls": v[0]}
                  for (c, a), v in sorted(_per.items()) if v[0]}
        return dict(_totals, per_op=per_op)


def reset() -> None:
    with _lock:
        for k in _totals:
            _totals[k] = 0
        for v in _per.values():  # zeroed, not dropped: counter() holders keep theirs
            v[:] = [0, 0, 0]
