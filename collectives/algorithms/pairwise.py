"""Pairwise exchange alltoall.

How it works: rank r copies its own block, then at step k = 1 .. n-1 sends its block for
rank (r + k) % n and receives the block from rank (r - k) % n, both non-blocking, so every
rank sends to and receives from exactly one peer per step and no link carries two
messages at once.

Cost for n ranks and m bytes sent per rank (evenly split; alpha latency, beta seconds per
byte, o our per-message overhead):
  alltoall   (n-1) (alpha + o) + (n-1)/n m beta
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from collectives.algorithms.costmodel import Layout, Params
from collectives.runtime.p2p import irecv, isend, offsets
from collectives.runtime.watchdog import wait_all

TAG_ALLTOALL = 61


def alltoall(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, send_counts: list[int],
             recv_counts: list[int]) -> None:
    """recv = block r of every rank's send, in rank order; send holds send_counts[j]
    elements for rank j, recv recv_counts[j] from rank j."""
    n, r = comm.Get_size(), comm.Get_rank()
    so, ro = offsets(send_counts), offsets(recv_counts)
    recv[ro[r]:ro[r + 1]] = send[so[r]:so[r + 1]]
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        wait_all(comm, [irecv(comm, recv[ro[src]:ro[src + 1]], src, TAG_ALLTOALL),
                        isend(comm, send[so[dst]:so[dst + 1]], dst, TAG_ALLTOALL)], "pairwise")


def cost(collective: str, nbytes: int, layout: Layout, p: Params) -> float:
    """Predicted seconds of one alltoall of nbytes per rank on layout (module docstring)."""
    n = layout.size
    if n <= 1:
        return 0.0
    step, beta = layout.message(p)
    return (n - 1) * step + (n - 1) / n * nbytes * beta
