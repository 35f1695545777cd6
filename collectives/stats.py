"""Counters of calls and bytes moved by our own algorithms.

Bytes are counted at the point-to-point layer, so they are exact for ring, tree and the
other algorithms we implement; for `mpi` (the MPI library's own collectives) the library's
internal traffic is invisible and only calls are counted.

Every writer runs inside a collective, and the engine runs one collective at a time, so the
counters have one writer at a time and take no lock (this is on every call's path). stats()
reads them as they are; a reset() while a collective runs may leave that call's counts."""

from __future__ import annotations

_totals = {"bytes_sent": 0, "bytes_received": 0, "calls": 0}
_per: dict[tuple[str, str], list[int]] = {}  # (collective, algorithm) -> [calls, sent, received]


def add_bytes(sent: int, received: int) -> None:
    _totals["bytes_sent"] += sent
    _totals["bytes_received"] += received


def snapshot() -> tuple[int, int]:
    return _totals["bytes_sent"], _totals["bytes_received"]


def counter(collective: str, algorithm: str) -> list[int]:
    """The [calls, sent, received] counter of (collective, algorithm), for count()."""
    return _per.setdefault((collective, algorithm), [0, 0, 0])


def totals() -> dict[str, int]:
    """The live totals, for C++ writers that count as count() does."""
    return _totals


def count(entry: list[int], sent: int, received: int, counted: bool = False) -> None:
    """One finished call moving these bytes, on a counter; counted: the bytes are already
    in the totals (add_bytes)."""
    if not counted:
        _totals["bytes_sent"] += sent
        _totals["bytes_received"] += received
    _totals["calls"] += 1
    entry[0] += 1
    entry[1] += sent
    entry[2] += received


def record_call(collective: str, algorithm: str, sent: int, received: int) -> None:
    """Attribute one finished call and the bytes it moved (already in the totals) to
    (collective, algorithm)."""
    count(counter(collective, algorithm), sent, received, counted=True)


def stats() -> dict:
    """{"bytes_sent", "bytes_received", "calls", "per_op": {"allreduce/ring": {...}}}."""
    per_op = {f"{c}/{a}": {"bytes_sent": v[1], "bytes_received": v[2], "calls": v[0]}
              for (c, a), v in sorted(_per.items()) if v[0]}
    return dict(_totals, per_op=per_op)


def reset() -> None:
    for k in _totals:
        _totals[k] = 0
    for v in _per.values():  # zeroed, not dropped: counter() holders keep theirs
        v[:] = [0, 0, 0]
