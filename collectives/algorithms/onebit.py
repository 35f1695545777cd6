"""The exchange of the 1-bit compressed allreduce (its arithmetic is
collectives/compression/onebit.py): each rank's packet for rank j all-to-all, then every
server packet to every rank (a reducescatter: the first exchange only); the buffers' sizes
(error_sizes, scatter_error_size) and the cost.
Cost per rank (alpha latency, beta seconds per byte, S scales per chunk: 1, or
ceil(L / block_size)):
  2(n-1) alpha + 2(n-1) (L/8 + 4 S) beta  =~  2(n-1)/n * padded/8 bytes
(plus the agreement's one small allgather) against a float32 ring allreduce's
2(n-1)/n * 4 count: about 32 times fewer bytes, 28 with a scale per 256 elements. With
block scales on the host, across nodes, the exchanges go in pieces
(compression/onebit.pipelined): the same bytes in ceil(L / PIECE) times as many messages,
and the kernels' time overlapped with the link's instead of added to it (on one node the
transfers are copies, and the pieces' messages cost more than they hide).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from collectives.algorithms.costmodel import Layout, Params
from collectives.runtime.p2p import irecv, isend
from collectives.runtime.watchdog import wait_all

TAG_SCATTER, TAG_GATHER = 51, 52

#: With block scales on the host, each chunk goes in pieces of about this many elements
#: (whole blocks): a piece's packet to a peer, PIECE/8 + 4 PIECE/block bytes (36 KiB at
#: block 256), is under Open MPI's TCP eager limit (64 KiB), so it leaves as soon as it is
#: compressed and travels while the next piece is compressed, served or decompressed,
#: instead of the link waiting for the whole vector's kernels.
PIECE = 1 << 18


def error_sizes(count: int, size: int) -> tuple[int, int]:
    """(worker_error, server_error) element counts for a vector of `count` elements on
    `size` ranks: count rounded up to a multiple of 8 * size (whole bytes of signs in every
    chunk), and that divided by size."""
    if not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"count: expected an int >= 0, got {count!r}")
    if not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size: expected an int >= 1, got {size!r}")
    padded = -(-int(count) // (8 * size)) * 8 * size
    return padded, padded // size


def scatter_error_size(counts: list[int]) -> int:
    """worker_error's element count for a 1-bit reducescatter whose block j has counts[j]
    elements: each block rounded up to a multiple of 8 (whole bytes of signs)."""
    return sum(-(-int(c) // 8) * 8 for c in counts)


def cost(nbytes: int, layout: Layout, p: Params,
         block_size: int | None = 32) -> float:
    """Predicted seconds of compressed_allreduce of nbytes of float32 on layout: the
    docstring's two exchanges over the slowest link, and the kernels (compress, serve,
    decompress): 5 gamma per byte of the vector, a constant fitted to the kernels' time
    (they stream the vector and its error buffers more than once; benchmarks/kernels.py).
    In one piece the two add up; in several (block scales, chunks over PIECE) they
    overlap, but for one piece's kernels, each piece's messages paying the latency."""
    n = layout.size
    if n <= 1:
        return 0.0
    _, chunk = error_sizes(max(nbytes // 4, 1), n)
    step, beta = layout.message(p)
    pieces = 1 if block_size is None else -(-chunk // PIECE)
    link = 2 * (n - 1) * (pieces * step + (chunk / 8 + 4 * nscales(chunk, block_size)) * beta)
    kernels = 5 * nbytes * p.gamma
    return link + kernels if pieces == 1 else max(link, kernels) + kernels / pieces


def received_bytes(count: int, n: int, block_size: int | None = 32) -> int:
    """Bytes each rank receives in compressed_allreduce of count float32 elements on n
    ranks: the two exchanges of the docstring, n - 1 chunks of signs and scales each."""
    if n <= 1:
        return 0
    _, chunk = error_sizes(count, n)
    return 2 * (n - 1) * (chunk // 8 + 4 * nscales(chunk, block_size))


def nscales(chunk: int, block: int | None) -> int:
    return 1 if block is None else -(-chunk // block)


def exchange(comm: MPI.Comm, send: list[np.ndarray], recv: np.ndarray, tag: int) -> None:
    """recv[j] = rank j's send[this rank], for every j (send[rank] is copied locally)."""
    r = comm.Get_rank()
    recv[r] = send[r]
    peers = [j for j in range(comm.Get_size()) if j != r]
    reqs = [irecv(comm, recv[j], j, tag) for j in peers]
    reqs += [isend(comm, send[j], j, tag) for j in peers]
    wait_all(comm, reqs, "1-bit exchange")
