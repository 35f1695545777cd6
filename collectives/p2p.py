"""Non-blocking point-to-point messages on flat host arrays, counted in stats.

Every algorithm of ours moves data through these two calls, so C.stats() sees every byte.
Messages go as MPI.BYTE: the element type only matters to the reduction kernels."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import stats


def isend(comm: MPI.Comm, buf: np.ndarray, dest: int, tag: int) -> MPI.Request:
    stats.add_bytes(buf.nbytes, 0)
    return comm.Isend([buf, MPI.BYTE], dest, tag)


def irecv(comm: MPI.Comm, buf: np.ndarray, source: int, tag: int) -> MPI.Request:
    stats.add_bytes(0, buf.nbytes)
    return comm.Irecv([buf, MPI.BYTE], source, tag)


def segments(count: int, seg: int) -> list[tuple[int, int]]:
    """[lo, hi) pieces of at most seg elements covering range(count)."""
    return [(lo, min(lo + seg, count)) for lo in range(0, count, seg)]


def even_bounds(count: int, parts: int) -> list[int]:
    """parts+1 offsets splitting count as evenly as possible, larger parts first."""
    base, extra = divmod(count, parts)
    offsets = [0]
    for p in range(parts):
        offsets.append(offsets[-1] + base + (1 if p < extra else 0))
    return offsets
