"""Ranks agree on what they are about to do before any data moves.

Every collective starts with an exchange of a header holding a digest of (collective, op,
dtype, shape, algorithm, ...), run by the engine for every call: equal digests everywhere
mean every rank made the same call. Across nodes the exchange is recursive doubling of
40-byte messages (csrc/runtime/agree.cpp); on a communicator whose ranks all share memory
it is one step on a shared window (csrc/runtime/agree_shared.cpp): every rank writes its
header beside its payload into its own buffer, waits once, and reads every rank's. Small
payloads ride in the same exchange: an allreduce of up to PIGGYBACK_BYTES (messages) or
SHARED_BYTES (shared memory) is reduced during its own check (no extra round trip), and
allgather's per-rank row counts travel the same way. On a mismatch every rank learns it in
the same step; a second round gathers the readable signatures so every rank raises the same
error, naming the field, the values and the ranks, and the communicator stays usable."""

from __future__ import annotations

import functools
import hashlib
import math
from typing import TYPE_CHECKING

from mpi4py import MPI

from collectives.kernels import _C
from collectives.runtime import flight
from collectives.runtime.window import Window, shares_memory

if TYPE_CHECKING:
    from collectives.runtime.watchdog import Limit, Watchdog


class MismatchError(ValueError, RuntimeError):
    """Ranks called a collective with different arguments (raised on every rank). A
    ValueError (the arguments) and a RuntimeError (what Horovod raises for it)."""


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
    """A message naming the first field that differs, its values and which ranks hold each;
    or, where some ranks' arguments were invalid, those ranks and what was wrong. Ranks
    inside join() are left out of the comparison and named at the end.

    A signature is (collective, ((field, value), ...)); an invalid call's fields are
    (("invalid", "TypeError: x: ..."),) (calls.invalid); a joined rank's is ("join", ())."""
    invalid = [(r, s[0], s[1][0][1]) for r, s in enumerate(signatures)
               if s[1] and s[1][0][0] == "invalid"]
    if invalid:
        return "; ".join(f"{collective}: rank {r} passed an invalid argument ({text})"
                         for r, collective, text in invalid)
    joined = [r for r, s in enumerate(signatures) if s[0] == "join"]
    ranked = [(r, s) for r, s in enumerate(signatures) if s[0] != "join"] or \
        list(enumerate(signatures))
    if len(ranked) == len(signatures):
        joined = []
    names = [(r, s[0]) for r, s in ranked]
    fields = [(r, dict(s[1])) for r, s in ranked]
    if len({name for _, name in names}) > 1:
        text = "collective mismatch: " + _groups("called", names)
    else:
        text = f"{names[0][1]} mismatch: " + _groups("has", [(r, repr(s[1])) for r, s in ranked])
        for key in dict.fromkeys(k for _, f in fields for k in f):  # every rank's fields
            values = [(r, repr(f.get(key))) for r, f in fields]
            if len({v for _, v in values}) > 1:
                text = f"{names[0][1]} {key} mismatch: " + _groups("has", values)
                break
    return text + (f" ({_ranks_text(joined)} in join())" if joined else "")


def _groups(verb: str, values: list[tuple[int, str]]) -> str:
    """'rank 0 has A, ranks 1-3 have B' for (rank, value) pairs."""
    order = list(dict.fromkeys(v for _, v in values))
    parts = []
    for v in order:
        ranks = [r for r, x in values if x == v]
        plural = verb if len(ranks) == 1 else {"has": "have", "called": "called"}[verb]
        parts.append(f"{_ranks_text(ranks)} {plural} {v}")
    return ", ".join(parts)


#: Largest allreduce payload carried inside the agreement messages (bytes).
PIGGYBACK_BYTES = 64 << 10
#: Largest allreduce payload carried by the shared-memory exchange (bytes): one step (copy
#: in, one wait, every rank folds every rank's whole copy) pays one wait where shm's
#: pipeline pays three per chunk, but each rank reads all L copies of the whole buffer
#: instead of L copies of its 1/L share, so the single step wins only for small payloads.
SHARED_BYTES = 128 << 10
#: The shared exchange's buffers per rank: two, as a rank writes exchange g + 1 while
#: slower ones may still read g, and no rank gets further ahead (it waits in g + 1 for
#: every rank's READY, which each posts only after reading g).
SHARED_DEPTH = 2
_SHARED_HEADER = 64  # csrc/runtime/agree_shared.cpp's header, cache-line aligned
_TAG = 20


def shared_window(comm: MPI.Comm) -> Window | None:
    """The window of comm's shared-memory exchange, if it has more than one rank and they
    all share memory; else None (collective over comm). Its waits report to the watchdog
    (the channel's), not to a stall limit of their own."""
    if comm.Get_size() == 1 or not shares_memory(comm):
        return None
    return Window(comm, _SHARED_HEADER + SHARED_BYTES, SHARED_DEPTH, math.inf)


def channel(comm: MPI.Comm, watchdog: Watchdog, limit: Limit,
            window: Window | None) -> _C.AgreeChannel:
    """comm's agreement exchange in C++ (csrc/runtime/agree.h): over window's shared memory
    with up to SHARED_BYTES of payload when given (shared_window), else messages of a
    40-byte header and up to PIGGYBACK_BYTES; a long wait calls the watchdog, which holds
    it to limit."""
    on_wait = functools.partial(watchdog.on_wait, limit)
    first = watchdog.first_deadline(limit)
    if window is None:
        return _C.AgreeChannel(comm, _TAG, PIGGYBACK_BYTES, first, on_wait)
    return _C.AgreeChannel(comm, _TAG, SHARED_BYTES, first, on_wait, window.native)


def raise_mismatch(comm: MPI.Comm, collective: str, fields: tuple) -> None:
    """After an exchange found ranks that differ: every rank raises the same MismatchError
    naming the field, the values and the ranks."""
    text = describe_mismatch(comm.allgather((collective, fields)))
    flight.dump(text.splitlines()[0])
    raise MismatchError(f"{text}\n{flight.where('every rank')}")


#: What may run while some ranks have joined (api/join.py): reductions, to which a joined rank
#: contributes the identity.
JOINABLE = ("allreduce", "grouped_allreduce")


def check_joinable(collective: str, fields: tuple, joined: int, size: int) -> None:
    """Raise MismatchError (on every rank: each one calls this with the same values) if a
    call cannot run while `joined` of the `size` ranks have joined."""
    if fields and fields[0][0] == "invalid":
        raise MismatchError(f"{collective}: the ranks that have not joined passed an invalid "
                            f"argument ({fields[0][1]})")
    if collective in JOINABLE:
        return
    ranks = "rank has" if joined == 1 else "ranks have"
    raise MismatchError(f"{collective}: {joined} of {size} {ranks} joined; until every rank "
                        f"has joined, only {' and '.join(JOINABLE)} can run")


def share_with_joined(comm: MPI.Comm, collective: str, fields: tuple, joined: int,
                      first_active: int) -> None:
    """An active rank's side of a call the agreement found joined ranks in: the lowest
    active rank sends the call's signature to every rank (the joined ones run their part
    of it, api/join.py), then every rank checks the call can run with joined ranks. An invalid
    call goes on to raise its own error."""
    comm.bcast((collective, fields) if comm.Get_rank() == first_active else None,
               root=first_active)
    if not (fields and fields[0][0] == "invalid"):
        check_joinable(collective, fields, joined, comm.Get_size())


def raise_invalid(comm: MPI.Comm, collective: str, fields: tuple, error: BaseException) -> None:
    """raise_mismatch's part on a rank whose own arguments were invalid: it joins the
    gathering of signatures the others make, then raises its own error."""
    comm.allgather((collective, fields))
    raise error
