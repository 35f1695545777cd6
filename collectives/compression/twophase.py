"""Block-quantized allreduce in two phases, whose bytes per rank do not grow with the ranks,
and reducescatter on two levels.

Quantized values cannot be added as they travel. The allgather form (every rank's
quantized vector to every rank, summed locally) has each rank receive (n-1) m b/8 bytes for
m elements of b bits; this one receives 2 (n-1)/n m b/8 at any n (DeepSpeed ZeRO++'s qgZ,
and the library's 1-bit exchange, move the same way):

  One level, n ranks (flat_reduce(), one_level()):
    1. the vector is cut into n chunks of whole scale blocks (chunk_bounds); every rank
       quantizes each chunk and sends chunk j to rank j (an alltoall)
    2. rank j decodes the n chunks it received and sums them in rank order in float32
       (an Average divides the sum once), then quantizes that sum again
    3. an allgather of the n reduced chunks; every rank decodes the whole vector from the
       same bytes, so the result is bit-identical on every rank
  Two levels, several nodes with more than one rank on some (hierarchical()):
    1. a float32 reduce-scatter inside each node, by shards (hierarchical allreduce's
       split: shard s to the local rank that owns it)
    2. the one-level form among the owners of each shard on every node
    3. a float32 allgather inside each node
    Only quantized values cross the links: each node sends 2 (N-1)/N m b/8 bytes for N
    nodes, spread over its ranks.

Error. With s_r the scale of rank r's block (max|x_r| / levels, levels 127 for int8, 7 for
int4) and S the scale of the block of the float32 sum (of the node sums, on two levels),
each element of the result is within sum_r s_r / 2 + S / 2 of the exact sum (an Average:
of the exact average, each term divided by the ranks): the first quantization's error on
every rank's contribution plus the second's on their sum. The allgather form has only the
first term. Where ranks' values are alike, S is about n s_r, so two phases about double
the allgather form's error.

Cost (`cost`, what `auto` compares, P = one rank's packet of m elements: m b/8 bytes plus
4 per block): allgather form: an allgather of n P plus decoding and adding n vectors;
two phases: an alltoall of P and an allgather of P plus decoding m elements twice, and on
two levels a float32 reduce-scatter and allgather of 4m inside the node. The allgather
form wins at 2 ranks (the same bytes in one step fewer) and for small vectors.

reducescatter() is the first phase alone (each block to its rank), on two levels across
nodes: a float32 reduce-scatter inside each node first, so that only quantized values cross
the links (see its docstring).

A codec is the compressor (compression/__init__.py: BlockQuantizer): codec.block elements
per scale, codec.quantize(x) -> (payload uint8, scales float32), codec.dequantize(payload,
scales, count, out), codec.payload_bytes(count)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from collectives import algorithms
from collectives.algorithms import costmodel, flat
from collectives.algorithms.costmodel import Layout
from collectives.auto import select
from collectives.kernels.args import nblocks
from collectives.ops import KERNEL_OP, ReduceOp
from collectives.runtime.p2p import even_bounds, offsets
from collectives.runtime.topology import Topology

#: The ways a block-quantized allreduce moves: every rank's vector to every rank, or the two
#: phases of this module; `auto` picks the cheaper by cost().
FORMS = ("allgather", "two-phase")


def packet_bytes(codec: Any, count: int) -> int:
    """Bytes of the packet of count elements: the payload, then 4 per scale."""
    return codec.payload_bytes(count) + 4 * nblocks(count, codec.block)


def chunk_bounds(count: int, n: int, block: int) -> list[int]:
    """n + 1 element offsets cutting count elements into n chunks of whole blocks, as even
    as whole blocks allow (the last chunk holds the partial block)."""
    return [min(b * block, count) for b in even_bounds(nblocks(count, block), n)]


def encode(codec: Any, x: np.ndarray, into: np.ndarray) -> None:
    """into (uint8, packet_bytes(x.size)) = x's packet."""
    payload, scales = codec.quantize(x)
    into[:payload.size] = payload.view(np.uint8)
    into[payload.size:] = scales.view(np.uint8)


def decode(codec: Any, packet: np.ndarray, count: int, out: np.ndarray) -> None:
    """out (float32, count elements) = the values of a packet of count elements."""
    size = codec.payload_bytes(count)
    scales = packet[size:].copy().view(np.float32)  # copied: the scales may sit unaligned
    codec.dequantize(packet[:size], scales, count, out)


def flat_reduce(codec: Any, x: np.ndarray, n: int, rank: int,
                alltoall: Callable[[np.ndarray, np.ndarray, list[int], list[int]], None],
                allgather: Callable[[np.ndarray, np.ndarray, list[int]], None],
                finish: Callable[[np.ndarray], None]) -> np.ndarray:
    """The one-level form over any transport: the sum over n ranks of every rank's float32
    host vector x (finish(chunk sum) applies an Average's division before it is quantized
    again), as a new float32 vector. alltoall(send, recv, send_counts, recv_counts) and
    allgather(send, recv, counts) move uint8 arrays over the n ranks."""
    bounds = chunk_bounds(x.size, n, codec.block)
    counts = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    sizes = [packet_bytes(codec, c) for c in counts]
    at = offsets(sizes)
    send = np.empty(at[-1], np.uint8)
    for j in range(n):
        if counts[j]:
            encode(codec, x[bounds[j]:bounds[j + 1]], send[at[j]:at[j + 1]])
    mine = sizes[rank]
    received = np.empty(n * mine, np.uint8)
    alltoall(send, received, sizes, [mine] * n)
    total = np.zeros(counts[rank], np.float32)
    part = np.empty_like(total)
    for r in range(n):  # rank order: the same bytes give the same bits on every rank
        if counts[rank]:
            decode(codec, received[r * mine:(r + 1) * mine], counts[rank], part)
            np.add(total, part, out=total)
    finish(total)
    reduced = np.empty(mine, np.uint8)
    if counts[rank]:
        encode(codec, total, reduced)
    gathered = np.empty(at[-1], np.uint8)
    allgather(reduced, gathered, sizes)
    out = np.empty(x.size, np.float32)
    for j in range(n):
        if counts[j]:
            decode(codec, gathered[at[j]:at[j + 1]], counts[j], out[bounds[j]:bounds[j + 1]])
    return out


def one_level(topo: Topology, codec: Any, x: np.ndarray, op: ReduceOp, algorithm: str
              ) -> np.ndarray:
    """flat_reduce() over topo's world. algorithm names the allgather's algorithm (and the
    alltoall's where it runs one), else `auto` chooses each."""
    def alltoall(send, recv, send_counts, recv_counts) -> None:
        algo = select.concrete(topo, "alltoall", algorithm if algorithm in
                               algorithms.ALLTOALL_ALGORITHMS else "auto", recv.nbytes)
        algorithms.alltoall(algo, topo, send, recv, send_counts, recv_counts)

    def allgather(send, recv, counts) -> None:
        algo = select.concrete(topo, "allgather", algorithm, recv.nbytes)
        algorithms.allgather(algo, topo, send, recv, counts)

    return flat_reduce(codec, x, topo.size, topo.rank, alltoall, allgather,
                       lambda total: algorithms.average(total, "float32", op, topo.size))


def _cross_moves(comm: Any, nbytes: int) -> tuple[Callable, Callable]:
    """(alltoall, allgather) over one rank per node (a shard's communicator): the cheapest
    flat algorithms there for a packet of nbytes."""
    layout, p = Layout((1,) * comm.Get_size()), costmodel.params()
    a2a = min(("mpi", "pairwise"),
              key=lambda a: algorithms.REGISTRY[a].cost("alltoall", nbytes, layout, p))
    ag = flat.FLAT[flat.cheapest("allgather", nbytes, layout, p)].allgather
    return (lambda send, recv, sc, rc: algorithms.REGISTRY[a2a].alltoall(comm, send, recv, sc, rc),
            lambda send, recv, counts: ag(comm, send, recv, counts))


def hierarchical(topo: Topology, codec: Any, x: np.ndarray, op: ReduceOp) -> np.ndarray:
    """The two-level form (module docstring) over topo's nodes, as a new float32 vector."""
    layout, p = Layout.of(topo), costmodel.params()
    node = layout.intra()
    out = np.empty(x.size, np.float32)
    shards = even_bounds(x.size, topo.max_local_size)
    owned = [s for s in range(topo.max_local_size) if topo.shard_owner(s) == topo.local_rank]
    counts = [0] * topo.local_size
    for s in range(topo.max_local_size):
        counts[topo.shard_owner(s)] += shards[s + 1] - shards[s]
    lo, hi = shards[owned[0]], shards[owned[-1] + 1]
    mine = out[lo:hi]
    rs = flat.cheapest("reducescatter", x.nbytes, node, p, flat.ours())
    flat.FLAT[rs].reducescatter(topo.node_comm, x, mine, counts, KERNEL_OP[ReduceOp.Sum],
                                "float32")
    for s in owned:
        comm = topo.shard_comm(s)
        piece = out[shards[s]:shards[s + 1]]
        alltoall, allgather = _cross_moves(comm, packet_bytes(codec, piece.size))
        piece[:] = flat_reduce(codec, piece, comm.Get_size(), comm.Get_rank(), alltoall,
                               allgather,
                               lambda total: algorithms.average(total, "float32", op,
                                                                topo.size))
    ag = flat.cheapest("allgather", x.nbytes, node, p, flat.ours())
    flat.FLAT[ag].allgather(topo.node_comm, mine, out, counts)
    return out


def even_nodes(topo: Topology) -> bool:
    """Whether every node has as many ranks (reducescatter's two levels need it)."""
    return len({len(node) for node in topo.nodes}) == 1


def reducescatter(topo: Topology, codec: Any, x: np.ndarray, counts: list[int], op: ReduceOp
                  ) -> np.ndarray:
    """Block topo.rank (counts[topo.rank] elements, float32) of the sum over every rank of
    the float32 host vector x (block j: counts[j] elements, rank j's), on two levels (even
    nodes of several ranks):
      1. a float32 reduce-scatter inside the node, local rank i receiving the node's sum of
         the blocks of every node's local rank i (the ranks of its cross communicator)
      2. among those ranks, each block quantized and sent to its rank (an alltoall); each
         decodes the N it receives and sums them in the communicator's rank order (an
         Average divides once)
    A node sends (N-1)/N m b/8 bytes across the links, where one level sends L times that
    (every rank's blocks for every other node's ranks)."""
    layout, p = Layout.of(topo), costmodel.params()
    i = topo.local_rank
    # the world ranks of each local index's cross communicator, in its rank order
    groups = [sorted(node[k] for node in topo.nodes) for k in range(topo.local_size)]
    starts = offsets(counts)
    pieces = [np.concatenate([x[starts[t]:starts[t + 1]] for t in group]) if group else
              np.empty(0, np.float32) for group in groups]
    node_counts = [piece.size for piece in pieces]
    mine = np.empty(node_counts[i], np.float32)
    rs = flat.cheapest("reducescatter", x.nbytes, layout.intra(), p, flat.ours())
    flat.FLAT[rs].reducescatter(topo.node_comm, np.concatenate(pieces), mine, node_counts,
                                KERNEL_OP[ReduceOp.Sum], "float32")
    group, comm = groups[i], topo.cross_comm
    sizes = [packet_bytes(codec, counts[t]) for t in group]
    at, held = offsets(sizes), offsets([counts[t] for t in group])
    send = np.empty(at[-1], np.uint8)
    for c in range(len(group)):
        if held[c + 1] > held[c]:
            encode(codec, mine[held[c]:held[c + 1]], send[at[c]:at[c + 1]])
    me, count = comm.Get_rank(), counts[topo.rank]
    received = np.empty(len(group) * sizes[me], np.uint8)
    alltoall, _ = _cross_moves(comm, at[-1])
    alltoall(send, received, sizes, [sizes[me]] * len(group))
    total, part = np.zeros(count, np.float32), np.empty(count, np.float32)
    for c in range(len(group)):  # the communicator's rank order: the same on every run
        if count:
            decode(codec, received[c * sizes[me]:(c + 1) * sizes[me]], count, part)
            np.add(total, part, out=total)
    algorithms.average(total, "float32", op, topo.size)
    return total


def two_levels(topo: Topology) -> bool:
    """Whether the two-phase form runs on two levels: several nodes, one with several ranks."""
    return len(topo.nodes) > 1 and topo.max_local_size > 1


def cost(form: str, topo: Topology, codec: Any, count: int) -> float:
    """Predicted seconds of a block-quantized allreduce of count elements in this form
    (module docstring), the call's agreement left out (both forms pay it once)."""
    n, p = topo.size, costmodel.params()
    layout = Layout.of(topo)
    agreement = select.agreement_cost(layout, p)

    def moved(collective: str, nbytes: int) -> float:
        return min(select.estimates(collective, nbytes, topo).values()) - agreement

    packet = packet_bytes(codec, count)
    if form == "allgather":
        return moved("allgather", n * packet) + n * 4 * count * p.gamma
    decoding = 3 * 4 * count * p.gamma  # the chunks' sum, its quantization, the whole vector
    if not two_levels(topo):
        return moved("alltoall", packet) + moved("allgather", packet) + decoding
    local, nodes = layout.max_local, layout.nodes
    node, cross = layout.intra(), Layout((1,) * nodes)
    piece = packet_bytes(codec, -(-count // local))
    return (flat.FLAT[flat.cheapest("reducescatter", 4 * count, node, p, flat.ours())].cost(
                "reducescatter", 4 * count, node, p)
            + min(algorithms.REGISTRY[a].cost("alltoall", piece, cross, p)
                  for a in ("mpi", "pairwise"))
            + flat.FLAT[flat.cheapest("allgather", piece, cross, p)].cost(
                "allgather", piece, cross, p)
            + flat.FLAT[flat.cheapest("allgather", 4 * count, node, p, flat.ours())].cost(
                "allgather", 4 * count, node, p)
            + decoding / local)


def received_bytes(form: str, codec: Any, n: int, count: int, rank: int = 0) -> int:
    """Bytes rank receives in one allreduce of count elements on one level of n ranks: in
    the allgather form n - 1 packets of the whole vector; in two phases n - 1 packets of
    its chunk (the alltoall) and every other rank's reduced chunk (the allgather)."""
    if n == 1:
        return 0
    if form == "allgather":
        return (n - 1) * packet_bytes(codec, count)
    bounds = chunk_bounds(count, n, codec.block)
    chunks = [packet_bytes(codec, b - a) for a, b in zip(bounds, bounds[1:])]
    return (n - 1) * chunks[rank] + sum(chunks) - chunks[rank]


def choose(topo: Topology, codec: Any, count: int) -> str:
    """The form `auto` runs: the cheaper by cost(), the same on every rank (it depends on
    the layout, the count and the tuning in force); on one rank the allgather form."""
    if topo.size == 1:
        return "allgather"
    return min(FORMS, key=lambda form: cost(form, topo, codec, count))


def allreduce(topo: Topology, codec: Any, x: np.ndarray, op: ReduceOp, algorithm: str
              ) -> np.ndarray:
    """The two-phase form on one level or two, as topo's layout asks (algorithm: the
    one-level form's data movement; two levels choose theirs by cost)."""
    if two_levels(topo):
        return hierarchical(topo, codec, x, op)
    return one_level(topo, codec, x, op, algorithm)
