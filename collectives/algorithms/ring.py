"""Ring allreduce, allgather, reducescatter and broadcast.

How it works: the buffer is cut into n chunks, one per rank. Reduce-scatter: in n-1 steps
every rank sends one chunk to its right neighbour and folds the chunk arriving from its left
into its own contribution; after the last step rank r holds chunk r reduced over all ranks.
Allgather: n-1 more steps pass the finished chunks around the ring. Each step is cut into
segments (Config.ring_segment_bytes) that are all posted non-blocking, and a segment is
reduced as soon as it lands, so the reduction of one segment overlaps the transfer of the
next. Across nodes a segment is at most Config.node_message_bytes (runtime/p2p.py,
most_bytes): a larger message waits for the receiver's reply, which queues behind the
peer's own data on a busy link. Every chunk is reduced on exactly one rank and then
copied, so all ranks end with bit-identical results.

Cost for n ranks and m bytes (alpha latency + o our per-message overhead, beta seconds per
byte, gamma seconds per byte reduced), as cost() computes it:
  allreduce      2(n-1) (alpha+o) + 2(n-1)/n m beta + (n-1)/n m gamma
  reducescatter   (n-1) (alpha+o) +  (n-1)/n m beta + (n-1)/n m gamma
  allgather       (n-1) (alpha+o) +  (n-1)/n m beta        (m = gathered bytes)
  broadcast      (n-2+s) (alpha+o) + m beta    (a chain: the last of s segments leaves
                                               the root at step s, then n-2 more hops)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from collectives import config, kernels
from collectives.algorithms.costmodel import Layout, Params
from collectives.ops import ReduceOp
from collectives.runtime.p2p import even_bounds, irecv, isend, most_bytes, offsets, segments
from collectives.runtime.watchdog import wait_all

TAG_RS, TAG_AG, TAG_BCAST = 11, 12, 13
#: Largest single message: keeps MPI's int counts in range whatever the buffer size.
MAX_MESSAGE_BYTES = 1 << 30


#: allreduce takes divisor= and divides, inside its own reduction, what each rank reduces
#: (algorithms.reduce folds an Average in that way).
FOLDS_AVERAGE = True

def _segment_elems(comm: MPI.Comm, itemsize: int, nbytes: int | None = None) -> int:
    """Elements per message on comm: Config.ring_segment_bytes (or nbytes), capped
    across nodes."""
    want = config.get().ring_segment_bytes if nbytes is None else nbytes
    return max(1, most_bytes(comm, want) // itemsize)


def _reduce_scatter(comm: MPI.Comm, send: np.ndarray, bounds: list[int], op: ReduceOp,
                    dtype: str, seg: int, dest: Callable[[int, int], np.ndarray],
                    divisor: int = 1) -> None:
    """Leave chunk c = [bounds[c], bounds[c+1]) reduced over all ranks in dest(n-2, r),
    divided by divisor (an Average: each segment of the last step as it is folded).

    dest(step, c) is where this rank writes its partial reduction of chunk c at that step;
    it is also what it sends on at the next step."""
    n, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    tmp = np.empty(max(bounds[c + 1] - bounds[c] for c in range(n)), dtype=send.dtype)
    outgoing = None
    for step in range(n - 1):
        sc, rc = (r - 1 - step) % n, (r - 2 - step) % n
        if outgoing is None:
            outgoing = send[bounds[sc]:bounds[sc + 1]]
        rlo, rlen = bounds[rc], bounds[rc + 1] - bounds[rc]
        pieces = segments(rlen, seg)
        recvs = [irecv(comm, tmp[a:b], left, TAG_RS) for a, b in pieces]
        sends = [isend(comm, outgoing[a:b], right, TAG_RS) for a, b in segments(outgoing.size, seg)]
        out = dest(step, rc)
        for (a, b), req in zip(pieces, recvs):
            wait_all(comm, [req], "ring")
            kernels.reduce(out[a:b], [send[rlo + a:rlo + b], tmp[a:b]], dtype, op)
            if divisor > 1 and step == n - 2:
                kernels.divide(out[a:b], dtype, divisor)
        wait_all(comm, sends, "ring")
        outgoing = out


def _ring_allgather(comm: MPI.Comm, buf: np.ndarray, bounds: list[int]) -> None:
    """Pass blocks around the ring until every rank has all of them in buf; rank r starts
    out holding block r."""
    n, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        sc, rc = (r - step) % n, (r - step - 1) % n
        sblock, rblock = buf[bounds[sc]:bounds[sc + 1]], buf[bounds[rc]:bounds[rc + 1]]
        seg = _segment_elems(comm, buf.itemsize, MAX_MESSAGE_BYTES)
        reqs = [irecv(comm, rblock[a:b], left, TAG_AG) for a, b in segments(rblock.size, seg)]
        reqs += [isend(comm, sblock[a:b], right, TAG_AG) for a, b in segments(sblock.size, seg)]
        wait_all(comm, reqs, "ring")


def allreduce(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
              dtype: str, divisor: int = 1) -> None:
    """recv = reduction of every rank's send (send may be recv), divided by divisor (an
    Average: each rank divides only the chunk it reduces, before the allgather)."""
    n = comm.Get_size()
    if n == 1 or recv.size == 0:
        if recv is not send:
            recv[...] = send
        return
    bounds = even_bounds(recv.size, n)
    seg = _segment_elems(comm, recv.itemsize)
    _reduce_scatter(comm, send, bounds, op, dtype, seg,
                    lambda step, c: recv[bounds[c]:bounds[c + 1]], divisor)
    _ring_allgather(comm, recv, bounds)


def reducescatter(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, counts: list[int],
                  op: ReduceOp, dtype: str) -> None:
    """recv = this rank's block (counts[rank] elements) of the reduction of every send."""
    n = comm.Get_size()
    bounds = offsets(counts)
    if n == 1:
        recv[...] = send
        return
    seg = _segment_elems(comm, send.itemsize)
    largest = max(counts)
    pingpong = [np.empty(largest, dtype=send.dtype) for _ in range(2)]

    def dest(step: int, c: int) -> np.ndarray:
        return recv if step == n - 2 else pingpong[step % 2][:counts[c]]

    _reduce_scatter(comm, send, bounds, op, dtype, seg, dest)


def allgather(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
    """recv = every rank's send concatenated in rank order (counts[i] elements from rank i)."""
    r = comm.Get_rank()
    bounds = offsets(counts)
    recv[bounds[r]:bounds[r + 1]] = send
    _ring_allgather(comm, recv, bounds)


def broadcast(comm: MPI.Comm, buf: np.ndarray, root: int) -> None:
    """buf on every rank = buf on root, passed down a pipelined chain root -> root+1 -> ..."""
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1 or buf.size == 0:
        return
    pos = (r - root) % n
    prev, nxt = (r - 1) % n, (r + 1) % n
    pieces = segments(buf.size, _segment_elems(comm, buf.itemsize))
    recvs = [irecv(comm, buf[a:b], prev, TAG_BCAST) for a, b in pieces] if pos > 0 else []
    sends = []
    for i, (a, b) in enumerate(pieces):
        if recvs:
            wait_all(comm, [recvs[i]], "ring")
        if pos < n - 1:
            sends.append(isend(comm, buf[a:b], nxt, TAG_BCAST))
    wait_all(comm, sends, "ring")


def cost(collective: str, nbytes: int, layout: Layout, p: Params) -> float:
    """Predicted seconds of one call on layout (the formulas in the module docstring)."""
    n, m = layout.size, nbytes
    if n <= 1:
        return 0.0
    step, beta = layout.message(p)
    share = (n - 1) / n * m
    if collective == "allreduce":
        return 2 * (n - 1) * step + 2 * share * beta + share * p.gamma
    if collective == "reducescatter":
        return (n - 1) * step + share * beta + share * p.gamma
    if collective == "allgather":
        return (n - 1) * step + share * beta
    cfg = config.get()
    seg = min(cfg.ring_segment_bytes, cfg.node_message_bytes) if layout.nodes > 1 \
        else cfg.ring_segment_bytes
    pieces = max(1, -(-m // seg))
    return (n - 2 + pieces) * step + m * beta
