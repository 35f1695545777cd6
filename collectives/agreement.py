"""Ranks agree on what they are about to do before any data moves.

Every collective starts with one tiny MPI_Allgather of (signature hash, dim-0 rows): equal
hashes mean every rank called the same collective with the same op, dtype, shape and
algorithm; the rows give allgather its per-rank sizes for free. On a mismatch a second
round gathers the readable signatures so every rank raises the same error, naming the field,
the values and the ranks, and the communicator stays usable."""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from .topology import Topology
from .watchdog import StallError


class MismatchError(ValueError):
    """Ranks called a collective with different arguments (raised on every rank)."""


@functools.lru_cache(maxsize=4096)
def _digest(signature: tuple) -> int:
    raw = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _ranks_text(ranks: list[int]) -> str:
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {','.join(spans)}"


def describe_mismatch(signatures: list[tuple]) -> str:
    """A message naming the first field that differs, its values and which ranks hold each.

    A signature is (collective, ((field, value), ...))."""
    names = [s[0] for s in signatures]
    if len(set(names)) > 1:
        return "collective mismatch: " + _groups("called", names)
    fields = [dict(s[1]) for s in signatures]
    for key in fields[0]:
        values = [repr(f.get(key)) for f in fields]
        if len(set(values)) > 1:
            return f"{names[0]} {key} mismatch: " + _groups("has", values)
    return f"{names[0]} mismatch: " + _groups("has", [repr(s[1]) for s in signatures])


def _groups(verb: str, values: list[str]) -> str:
    order = list(dict.fromkeys(values))
    parts = []
    for v in order:
        ranks = [r for r, x in enumerate(values) if x == v]
        plural = verb if len(ranks) == 1 else {"has": "have", "called": "called"}[verb]
        parts.append(f"{_ranks_text(ranks)} {plural} {v}")
    return ", ".join(parts)


def agree(topo: Topology, collective: str, fields: tuple, rows: int = 0) -> np.ndarray:
    """Check that every rank passes the same (collective, fields); return each rank's rows.

    fields is a tuple of (name, value) pairs. Raises MismatchError on every rank if not;
    a long wait is reported and, past the stall timeout, fails (see watchdog.py)."""
    dog, comm = topo.watchdog, topo.comm
    if dog.failed:
        raise StallError(f"collectives is unusable after a stall timeout ({dog.failed}); "
                         "an MPI collective cannot be cancelled: restart the job")
    signature = (collective, fields)
    mine = np.array([_digest(signature), rows], dtype=np.int64)
    everyone = np.empty((comm.Get_size(), 2), dtype=np.int64)
    dog.record.enter(collective, fields)
    cfg = topo.config
    dog.wait(comm.Iallgather(mine, everyone), cfg.stall_warning_s, cfg.stall_timeout_s)
    dog.record.state = "running"
    if (everyone[:, 0] != mine[0]).any():
        raise MismatchError(describe_mismatch(comm.allgather(signature)))
    return everyone[:, 1]
