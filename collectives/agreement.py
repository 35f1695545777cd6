"""Ranks agree on what they are about to do before any data moves.

Every collective starts with a recursive-doubling exchange of a 32-byte header holding a
digest of (collective, op, dtype, shape, algorithm, ...) (csrc/cpu/agree.cpp): equal digests
everywhere mean every rank made the same call. Small payloads ride in the same messages: an
allreduce of up to PIGGYBACK_BYTES is reduced during its own check (no extra round trip), and
allgather's per-rank row counts travel the same way. On a mismatch every rank learns it in
the same step; a second round gathers the readable signatures so every rank raises the same
error, naming the field, the values and the ranks, and the communicator stays usable."""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from . import kernels
from .dtypes import CODES
from .ops import ReduceOp
from .topology import Topology
from .watchdog import StallError


class MismatchError(ValueError):
    """Ranks called a collective with different arguments (raised on every rank)."""


@functools.lru_cache(maxsize=4096)
def digest(signature: tuple) -> int:
    """A 64-bit digest of (collective, fields), equal on every rank for equal calls."""
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


#: Largest allreduce payload carried inside the agreement messages (bytes).
PIGGYBACK_BYTES = 64 << 10
_TAG = 20
_NO_DATA = np.empty(0, np.uint8)


def agree(topo: Topology, collective: str, fields: tuple) -> None:
    """Check that every rank passes the same (collective, fields), a tuple of (name, value)
    pairs. Raises MismatchError on every rank if not; a long wait is reported and, past the
    stall timeout, fails (see watchdog.py)."""
    exchange(topo, collective, fields, _NO_DATA, _NO_DATA, "uint8", ReduceOp.Sum)


def agree_rows(topo: Topology, collective: str, fields: tuple, rows: int) -> np.ndarray:
    """agree(), also returning every rank's `rows` (allgather's per-rank sizes)."""
    n = topo.size
    if 8 * n > PIGGYBACK_BYTES:  # very large jobs: a second, plain allgather
        agree(topo, collective, fields)
        return np.array(topo.comm.allgather(rows), dtype=np.int64)
    mine = np.zeros(n, np.int64)
    mine[topo.rank] = rows
    everyone = np.empty(n, np.int64)
    exchange(topo, collective, fields, mine, everyone, "int64", ReduceOp.Sum)
    return everyone


def exchange(topo: Topology, collective: str, fields: tuple, send: np.ndarray,
             out: np.ndarray, dtype: str, op: int) -> int:
    """The agreement exchange reducing send into out (kernel op code); returns the payload
    bytes this rank sent (= received), not yet in stats."""
    return exchange_digest(topo, collective, fields, digest((collective, fields)), send, out,
                           send.size, CODES[dtype], op, 1)


def exchange_digest(topo: Topology, collective: str, fields: tuple, signature_digest: int,
                    send: np.ndarray, out: np.ndarray, count: int, dtype_code: int, op: int,
                    divisor: int) -> int:
    """exchange() with the digest of (collective, fields) and the codes computed by the
    caller (allreduce plans keep them per distinct call), dividing the result by divisor."""
    dog = topo.watchdog
    if dog.failed:
        raise StallError(f"collectives is unusable after a stall timeout ({dog.failed}); "
                         "an MPI collective cannot be cancelled: restart the job")
    dog.record.enter(collective, fields)
    moved = channel(topo).exchange(signature_digest, send, out, count, dtype_code, op, divisor)
    dog.record.state = "running"
    if moved < 0:
        raise_mismatch(topo, collective, fields)
    return moved


def channel(topo: Topology) -> kernels._C.AgreeChannel:
    """topo's agreement exchange in C++ (made on first use)."""
    if topo.agree_channel is None:
        dog = topo.watchdog
        topo.agree_channel = kernels._C.AgreeChannel(
            topo.comm_handle, _TAG, PIGGYBACK_BYTES, dog.first_deadline, dog.on_wait)
    return topo.agree_channel


def raise_mismatch(topo: Topology, collective: str, fields: tuple) -> None:
    """After an exchange found ranks that differ: every rank raises the same MismatchError
    naming the field, the values and the ranks."""
    raise MismatchError(describe_mismatch(topo.comm.allgather((collective, fields))))
