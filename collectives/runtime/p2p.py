"""Non-blocking point-to-point messages on flat host arrays, counted by the engine.

Every algorithm of ours moves data through these two calls, so C.stats() sees every byte.
Messages go as MPI.BYTE: the element type only matters to the reduction kernels. A
communicator may carry a cap on the size of the messages sent on it (cap_messages), which
the algorithms that cut their data into messages read (most_bytes)."""

from __future__ import annotations

import functools
import itertools

import numpy as np
from mpi4py import MPI

from collectives.runtime.engine import ENGINE

#: Counts are C ints in MPI 3.1 (what Open MPI 5.0 implements): larger messages travel as
#: one element of a derived type made of 1 GiB pieces plus the remainder.
_PIECE = 1 << 30


@functools.cache
def _big_type(nbytes: int) -> MPI.Datatype:
    pieces, rest = divmod(nbytes, _PIECE)
    piece = MPI.BYTE.Create_contiguous(_PIECE)
    whole = MPI.Datatype.Create_struct([pieces, rest], [0, pieces * _PIECE], [piece, MPI.BYTE])
    whole.Commit()
    return whole


def message(buf: np.ndarray) -> list:
    """An mpi4py message spec for buf's bytes, whatever its size."""
    if buf.nbytes < 1 << 31:
        return [buf, MPI.BYTE]
    return [buf, 1, _big_type(buf.nbytes)]


@functools.cache  # created on first use: MPI must be initialized
def _cap_key() -> int:
    return MPI.Comm.Create_keyval()


def cap_messages(comm: MPI.Comm, nbytes: int) -> None:
    """Let the algorithms on comm send no message over nbytes (an MPI attribute: it goes
    with comm). Topology caps the communicators whose ranks span nodes
    (Config.node_message_bytes)."""
    if not isinstance(nbytes, int) or nbytes < 1:
        raise ValueError(f"node_message_bytes: expected a positive int, got {nbytes!r}")
    comm.Set_attr(_cap_key(), nbytes)


def most_bytes(comm: MPI.Comm, nbytes: int) -> int:
    """The size of the messages an algorithm that would send nbytes at a time sends on
    comm: nbytes, or less under comm's cap (cap_messages). Both ends of a message ask
    with the same nbytes, so their pieces match."""
    cap = comm.Get_attr(_cap_key())
    return nbytes if cap is None else min(nbytes, cap)


def isend(comm: MPI.Comm, buf: np.ndarray, dest: int, tag: int) -> MPI.Request:
    ENGINE.native.add_bytes(buf.nbytes, 0)
    return comm.Isend(message(buf), dest, tag)


def irecv(comm: MPI.Comm, buf: np.ndarray, source: int, tag: int) -> MPI.Request:
    ENGINE.native.add_bytes(0, buf.nbytes)
    return comm.Irecv(message(buf), source, tag)


def count(comm: MPI.Comm, sent: int, received: int) -> None:
    """Count a transfer that is not a message of ours (the MPI library's collective, the
    shared window's copies) as the payload this rank contributes and receives; nothing on
    a communicator of one rank."""
    if comm.Get_size() > 1:
        ENGINE.native.add_bytes(sent, received)


def segments(count: int, seg: int) -> list[tuple[int, int]]:
    """[lo, hi) pieces of at most seg elements covering range(count)."""
    return [(lo, min(lo + seg, count)) for lo in range(0, count, seg)]


def offsets(counts: list[int]) -> list[int]:
    """len(counts) + 1 offsets: where each of counts' consecutive blocks starts, then the
    end."""
    return list(itertools.accumulate(counts, initial=0))


def even_split(count: int, parts: int) -> list[int]:
    """count split into parts as evenly as possible, larger parts first: the first
    count % parts get one more (Horovod's rule for reducescatter's rows; every even split
    in the library is this one)."""
    base, extra = divmod(count, parts)
    return [base + (1 if p < extra else 0) for p in range(parts)]


def even_bounds(count: int, parts: int) -> list[int]:
    """parts+1 offsets of even_split(count, parts)."""
    return offsets(even_split(count, parts))
