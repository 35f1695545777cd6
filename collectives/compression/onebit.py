"""1-bit compressed allreduce with error feedback (DeepSpeed's 1-bit Adam communication).

How it works, for n ranks and a vector of `count` elements padded with zeros to `padded`
(a multiple of 8n) and cut into n chunks of L = padded / n elements:
  worker   c = x + worker_error is sent as its signs and a scale (the rms of c: one for the
           whole vector, or one per block of `block_size` elements of a chunk); whatever
           the signs and scale miss stays in worker_error, to be sent next call.
  scatter  all-to-all: rank j receives chunk j of every rank's signs and their scale(s).
  server   rank j averages the n decompressed chunks (in rank order), adds server_error,
           and compresses that again, keeping what is lost in server_error.
  gather   allgather of the server chunks and scales; every rank decompresses the whole
           vector from the same bytes, so results are bit-identical everywhere.
Error feedback makes the compression unbiased over time: what one call loses, the next call
sends, so the sum of the results tracks the sum of the exact averages.

Buffers (see error_sizes): worker_error holds `padded` float32 elements and server_error
padded / n; both are this rank's own state, updated in place, and start as zeros.

The exchange, the buffers' sizes and the cost: collectives/algorithms/onebit.py.
Every message goes through collectives/runtime/p2p.py, so collectives.stats() counts
them, under "compressed_allreduce/onebit".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from collectives import kernels
from collectives.algorithms import onebit as onebit_exchange
from collectives.compression import Compressor
from collectives.dtypes import FLOATING
from collectives.ops import ReduceOp
from collectives.runtime import topology
from collectives.runtime.buffers import Buffer, to_device, to_host, wrap
from collectives.runtime.p2p import irecv, isend, offsets, segments
from collectives.runtime.watchdog import wait_all

# ------------------------------------------------------------------------- argument checks


def check_x(x: Any, name: str = "x") -> Buffer:
    buf = wrap(x, name)
    if buf.dtype not in FLOATING:
        raise TypeError(f"{name}: expected a floating dtype {list(FLOATING)}, got {buf.dtype}")
    return buf


def check_error(error: Any, name: str, expected: int) -> Buffer:
    buf = wrap(error, name)
    if buf.dtype != "float32":
        raise TypeError(f"{name}: expected float32, got {buf.dtype}")
    if len(buf.shape) != 1 or buf.shape[0] != expected:
        raise ValueError(f"{name}: expected a 1-D array of {expected} elements, got shape "
                         f"{buf.shape} (see collectives.algorithms.onebit.error_sizes)")
    return buf


def check_block(block_size: object) -> int | None:
    if block_size is None:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or block_size < 1:
        raise ValueError(f"block_size: expected None or an int >= 1, got {block_size!r}")
    return int(block_size)


# ------------------------------------------------------------------------------- packets
# A packet is one chunk's signs (L/8 bytes) followed by its float32 scales, as uint8: one
# message per peer and phase.


def _split(packet: Any, chunk: int) -> tuple[Any, Any]:
    """(signs, scales) of a packet; scales copied out, since they may sit unaligned."""
    return packet[:chunk // 8], packet[chunk // 8:].copy().view(np.float32)


def _xp(x: Any) -> Any:
    """NumPy for host arrays, CuPy for device arrays: where a step's buffers are made."""
    if isinstance(x, np.ndarray):
        return np
    import cupy
    return cupy


def _worker_packets(x: Any, error: Any, n: int, block: int | None) -> Any:
    """Row j: chunk j of x + error as signs and scale(s); error keeps what they miss. On
    x's side: host, or the device for device data."""
    chunk, xp = x.size // n, _xp(x)
    rows = xp.empty((n, chunk // 8 + 4 * onebit_exchange.nscales(chunk, block)), np.uint8)
    if block is None:  # DeepSpeed: one scale for the whole vector, repeated in every packet
        bits, scale = kernels.onebit_compress(x, error)
        rows[:, :chunk // 8] = bits.reshape(n, chunk // 8)
        rows[:, chunk // 8:] = xp.asarray(scale, np.float32).reshape(1).view(np.uint8)
        return rows
    return _block_rows(x.reshape(n, chunk), error.reshape(n, chunk), block, rows)


def _block_rows(xs: Any, errors: Any, block: int, rows: Any) -> Any:
    """rows[j] = xs[j] + errors[j] as signs and block scales; errors[j] keeps what they
    miss (xs, errors: 2-D, each row contiguous; rows: uint8, one packet per row)."""
    length = xs.shape[1]
    for j in range(len(xs)):
        bits, scales = kernels.onebit_compress(xs[j], errors[j], block)
        rows[j, :length // 8] = bits
        rows[j, length // 8:] = scales.view(np.uint8)
    return rows


def _padded(x: Any, size: int) -> Any:
    """x as a float32 vector of size elements: x itself if it is one, else a copy on x's
    side followed by zeros."""
    if x.dtype == np.float32 and x.size == size:
        return x
    padded = _xp(x).zeros(size, np.float32)
    padded[:x.size] = x
    return padded


def _serve(rows: np.ndarray, error: Any, block: int | None) -> Any:
    """This rank's chunk: the average of every rank's (rows[k], host) plus error, compressed
    again into one packet; error keeps what the packet misses. For a device error buffer
    the accumulation and compression run on the device (onebit_accumulate into zeros, then
    onebit_compress: onebit_serve's bits); the scales are divided by n on the host either
    way, so both give the same bits."""
    n, chunk = rows.shape[0], error.size
    parts = [_split(row, chunk) for row in rows]
    scaled = [scales / np.float32(n) for _, scales in parts]
    if isinstance(error, np.ndarray):
        bits, scales = kernels.onebit_serve([bits for bits, _ in parts], scaled, error, block)
        return np.concatenate([bits, np.asarray(scales, np.float32).reshape(-1).view(np.uint8)])
    import cupy

    with error.device:
        acc = cupy.zeros(chunk, cupy.float32)
        kernels.onebit_accumulate(acc, [to_device(bits, error) for bits, _ in parts],
                                  [to_device(s, error) for s in scaled], chunk, block)
        bits, scales = kernels.onebit_compress(acc, error, block)
        return cupy.concatenate([bits, cupy.asarray(scales, cupy.float32).reshape(-1)
                                 .view(cupy.uint8)])


def _decompress(rows: Any, chunk: int, block: int | None, out: Any) -> None:
    """out = the whole vector (its first out.size elements) from every rank's server packet
    (rows[j] = chunk j), decompressed in place (rows and out both host or both device)."""
    for j, row in enumerate(rows):
        lo, hi = j * chunk, min((j + 1) * chunk, out.size)
        if lo < hi:
            bits, scales = _split(row, chunk)
            if isinstance(out, np.ndarray):
                kernels.onebit_decompress(bits, scales, hi - lo, block, out=out[lo:hi])
            else:
                out[lo:hi] = kernels.onebit_decompress(bits, scales, hi - lo, block)


# -------------------------------------------------------------------------------- driver

class OnebitState(NamedTuple):
    """One vector's error-feedback state, held by the caller across calls: float32 arrays
    of error_sizes(count, ranks) elements, updated in place; host arrays, or CuPy arrays
    on x's device for device data."""

    worker_error: Any
    server_error: Any
    block_size: int | None


def reduce(x: Any, state: OnebitState, n: int,
           scatter: Callable[[np.ndarray], np.ndarray],
           gather: Callable[[np.ndarray], np.ndarray], out: Any = None) -> Any:
    """The algorithm of the module docstring over any transport: the average over n ranks
    of every rank's flat floating array x, as float32, with state's error buffers updated.
    scatter(rows) must return the rows received (row j: rank j's row for this rank),
    gather(packet) every rank's packet as rows, in rank order: host arrays. x and the error
    buffers are host arrays, or CuPy arrays on one device: then compression, the server's
    accumulation and decompression run there, and only the packets are staged. out: a flat
    float32 array of x.size elements on x's side to write the average into (x itself may
    be it: x is read before out is written), else a new one; returned."""
    worker, server, block = state
    xp = _xp(x)
    out = xp.empty(x.size, np.float32) if out is None else out
    if not worker.size:
        return out
    padded = _padded(x, worker.size)
    # worker: compress, then all-to-all so that rank j holds chunk j from everyone
    received = scatter(to_host(_worker_packets(padded, worker, n, block)))
    # server: average and compress this rank's chunk, then allgather every server chunk
    gathered = gather(to_host(_serve(received, server, block)))
    _decompress(to_device(gathered, out), server.size, block, out)
    return out


def reduce_scatter(x: np.ndarray, error: np.ndarray, counts: list[int], rank: int,
                   block: int | None,
                   scatter: Callable[[list[np.ndarray]], np.ndarray]) -> np.ndarray:
    """Block `rank` (counts[rank] elements, float32) of the average over len(counts) ranks
    of every rank's flat host array x, whose block j has counts[j] elements: the worker
    step and the all-to-all of the module docstring, each block compressed on its own
    (error: scatter_error_size(counts) float32 elements, its part of every block updated in
    place); then this rank decompresses the packets for its block and sums them in rank
    order. scatter(packets) must return the packets received as rows, row j rank j's."""
    n = len(counts)
    padded = [-(-c // 8) * 8 for c in counts]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    errors = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
    packets = []
    for j in range(n):
        if not padded[j]:
            packets.append(np.empty(0, np.uint8))
            continue
        c = np.zeros(padded[j], np.float32)
        c[:counts[j]] = x[starts[j]:starts[j + 1]]
        bits, scales = kernels.onebit_compress(c, error[errors[j]:errors[j + 1]], block)
        packets.append(np.concatenate([bits, np.asarray(scales, np.float32).reshape(-1)
                                       .view(np.uint8)]))
    received = scatter(packets)
    total = np.zeros(counts[rank], np.float32)
    for row in received:  # rank order
        if padded[rank]:
            bits, scales = _split(row, padded[rank])
            total += kernels.onebit_decompress(bits, scales, padded[rank], block)[:counts[rank]]
    total /= np.float32(n)
    return total


def _messages(chunks: list[int], block: int) -> list[list[tuple[int, int, int]]]:
    """How pipelined() cuts a group of vectors whose chunks have these lengths: messages in
    order, each a list of (vector, lo, hi) pieces of those chunks. Pieces are whole blocks
    of about PIECE elements; consecutive pieces share a message while its packet stays
    within a whole piece's bytes, so one long vector goes a piece a message and many short
    ones go together."""
    unit = math.lcm(8, block)
    piece = max(onebit_exchange.PIECE // unit, 1) * unit
    limit = _packet_bytes(piece, block)
    out: list[list[tuple[int, int, int]]] = []
    size = limit
    for v, chunk in enumerate(chunks):
        for lo, hi in segments(chunk, piece):
            nbytes = _packet_bytes(hi - lo, block)
            if size + nbytes > limit:
                out.append([])
                size = 0
            out[-1].append((v, lo, hi))
            size += nbytes
    return out


def _packet_bytes(length: int, block: int | None) -> int:
    """Bytes of the packet of `length` elements (a multiple of 8): signs, then scales."""
    return length // 8 + 4 * onebit_exchange.nscales(length, block)


def pipelined(comm: MPI.Comm, xs: list[np.ndarray], states: list[OnebitState],
              outs: list[Any] | None = None) -> list[np.ndarray]:
    """reduce() of each host vector xs[v] with states[v] (block scales), over comm's
    messages piece by piece: the pieces of every chunk (_messages(): whole blocks, short
    vectors' pieces sharing a message) go through the worker, the scatter, the server and
    the gather in turn, and while one message travels the next is compressed (every
    receive is posted first; MPI matches a peer's messages of one tag in the order sent).
    Every block lies inside one piece, so each vector's bits, result and error buffers are
    reduce()'s; only the messages differ. outs[v]: where to write xs[v]'s average (see
    reduce()), else new arrays; returned."""
    blocks = {state.block_size for state in states}
    if None in blocks or len(blocks) > 1:
        raise ValueError(f"states: pipelined needs one block size, not None, got {blocks}")
    block = blocks.pop() if blocks else 1
    n, r = comm.Get_size(), comm.Get_rank()
    outs = [np.empty(x.size, np.float32) if o is None else o
            for x, o in zip(xs, outs or [None] * len(xs))]
    chunks = [state.server_error.size for state in states]
    xs = [_padded(x, s.worker_error.size).reshape(n, c) for x, s, c in zip(xs, states, chunks)]
    errors = [s.worker_error.reshape(n, c) for s, c in zip(states, chunks)]
    plan = []  # per message: its pieces as (vector, lo, hi, offset in the packet, bytes)
    for pieces in _messages(chunks, block):
        at = offsets([_packet_bytes(hi - lo, block) for _, lo, hi in pieces])
        plan.append([(v, lo, hi, a, b) for (v, lo, hi), a, b in zip(pieces, at, at[1:])])
    peers = [j for j in range(n) if j != r]
    tags = onebit_exchange.TAG_SCATTER, onebit_exchange.TAG_GATHER
    rows = [[np.empty((n, m[-1][4]), np.uint8) for m in plan] for _ in tags]
    recvs = [[[irecv(comm, phase[i][j], j, tag) for j in peers] for i in range(len(plan))]
             for phase, tag in zip(rows, tags)]
    sends: list[MPI.Request] = []
    done = [0, 0]  # messages served, messages decompressed

    def send(tag: int, packet: Callable[[int], np.ndarray]) -> None:
        sends.extend(isend(comm, packet(j), j, tag) for j in peers)

    def serve(i: int) -> None:
        mine = rows[1][i][r]
        for v, lo, hi, a, b in plan[i]:
            mine[a:b] = _serve(rows[0][i][:, a:b], states[v].server_error[lo:hi], block)
        send(tags[1], lambda j: mine)  # the same packet to every peer

    def unpack(i: int) -> None:
        for v, lo, hi, a, b in plan[i]:
            chunk, out = chunks[v], outs[v]
            for j, row in enumerate(rows[1][i]):
                start, stop = j * chunk + lo, min(j * chunk + hi, out.size)
                if start < stop:
                    bits, scales = _split(row[a:b], hi - lo)
                    kernels.onebit_decompress(bits, scales, stop - start, block,
                                              out=out[start:stop])

    def ready(phase: int, i: int, wait: bool) -> bool:
        if wait:
            wait_all(comm, recvs[phase][i], "1-bit exchange")
            return True
        return MPI.Request.Testall(recvs[phase][i])

    def advance(compressed: int, wait: bool) -> None:
        """Serve, then decompress, the messages whose data are in, in order, of the first
        `compressed` (wait: all of them)."""
        while done[0] < compressed and ready(0, done[0], wait):
            serve(done[0])
            done[0] += 1
        while done[1] < done[0] and ready(1, done[1], wait):
            unpack(done[1])
            done[1] += 1

    for i, pieces in enumerate(plan):
        # the worker's packets: row r kept, the others sent
        packets = np.empty_like(rows[0][i])
        for v, lo, hi, a, b in pieces:
            _block_rows(xs[v][:, lo:hi], errors[v][:, lo:hi], block, packets[:, a:b])
        rows[0][i][r] = packets[r]
        send(tags[0], packets.__getitem__)  # row j to rank j
        advance(i + 1, wait=False)
    advance(len(plan), wait=True)
    wait_all(comm, sends, "1-bit exchange")
    return outs


class OnebitCompressor(Compressor):
    """1-bit signs plus scales with error feedback (the algorithm in the module docstring),
    over our own messages. Average only; its state (OnebitState) is the caller's, since
    what one call loses the next call on the same vector must send."""

    name = "onebit"
    ops = (ReduceOp.Average,)

    def allreduce(self, topo: topology.Topology, x: np.ndarray, op: ReduceOp, algorithm: str,
                  state: OnebitState | None = None, out: Any = None) -> np.ndarray:
        """out: where to write the average (see reduce()), else a new array."""
        if state is None:
            raise ValueError("state: 1-bit compression needs the caller's OnebitState "
                             "(error buffers); use compressed_allreduce")
        return self.grouped_allreduce(topo, [x], [state], [out])[0]

    def grouped_allreduce(self, topo: topology.Topology, xs: list[Any],
                          states: list[OnebitState], outs: list[Any]) -> list[Any]:
        """Each xs[v]'s average with states[v], into outs[v] (or a new array where None):
        the bits of one allreduce() each, in order. Host vectors with block scales across
        nodes go pipelined(), their pieces sharing messages (the link is the slow part);
        the others one reduce() each."""
        comm, n = topo.comm, topo.size
        if len(topo.nodes) > 1 and all(isinstance(x, np.ndarray) for x in xs) \
                and all(state.block_size is not None for state in states):
            return pipelined(comm, xs, states, outs)

        def scatter(rows: np.ndarray) -> np.ndarray:
            received = np.empty_like(rows)
            onebit_exchange.exchange(comm, list(rows), received, onebit_exchange.TAG_SCATTER)
            return received

        def gather(packet: np.ndarray) -> np.ndarray:
            gathered = np.empty((n, packet.size), np.uint8)
            onebit_exchange.exchange(comm, [packet] * n, gathered, onebit_exchange.TAG_GATHER)
            return gathered

        return [reduce(x, state, n, scatter, gather, out)
                for x, state, out in zip(xs, states, outs)]

    def reducescatter(self, topo: topology.Topology, x: np.ndarray, counts: list[int],
                      op: ReduceOp, algorithm: str, state: OnebitState | None = None
                      ) -> np.ndarray:
        """reduce_scatter over our own messages; state.worker_error has
        scatter_error_size(counts) elements (server_error is not used)."""
        if state is None:
            raise ValueError("state: 1-bit compression needs the caller's error buffer; use "
                             "compressed_reducescatter")
        comm, r = topo.comm, topo.rank

        def scatter(packets: list[np.ndarray]) -> np.ndarray:
            received = np.empty((topo.size, packets[r].size), np.uint8)
            onebit_exchange.exchange(comm, packets, received, onebit_exchange.TAG_SCATTER)
            return received

        return reduce_scatter(x, state.worker_error, counts, r, state.block_size, scatter)


ONEBIT = OnebitCompressor()
