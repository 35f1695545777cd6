"""Two-level collectives: inside each node first, then across nodes, then inside again.

How it works.
  allreduce      The buffer is cut into S shards (S = ranks on the largest node); each
                 local rank owns a contiguous run of shards (one each on full nodes).
                 1. intra-node reduce-scatter: each local rank gets its shards reduced over
                    its node; 2. inter-node allreduce of each shard among the ranks owning
                    it on every node; 3. intra-node allgather. Every node sends one buffer's
                    worth across nodes in total, spread over all its ranks.
                 Pipelined: the buffer is first cut into k chunks (chunks(): the count
                 priced cheapest, shards of at least SHARD_BYTES) that go through the three
                 steps one after another. A thread of the call's own runs step 2 of each
                 chunk while the caller's thread runs steps 1 and 3 of its neighbours
                 (chunk i+1 reduced, chunk i-1 spread), so the link stays busy while the
                 node works. Each thread calls its steps in chunk order, the same on every
                 rank, and the two use different communicators (node, shard), which takes
                 MPI_THREAD_MULTIPLE, and a CPU for each thread (overlaps()). Without
                 them, or below MIN_PIPELINED chunks, the chunks run in sequence (still
                 in messages of about SHARD_BYTES, sent eagerly: mpi_defaults.py).
  allgather      1. intra-node allgather of the node's rows; 2. node leaders (local rank 0)
                 allgather the node blocks; 3. leaders broadcast the result in their node.
  reducescatter  1. intra-node reduce to the leader; 2. leaders reduce-scatter node-sized
                 blocks; 3. each leader hands every local rank its rows.
  broadcast      root -> its node leader -> all leaders -> every rank of each node.
Uneven nodes (e.g. 2 + 1 ranks) work: a smaller node's ranks own more shards.

Each level runs the flat algorithm that is cheapest there for its step's size (`plan`,
which both the collectives below and cost() call, so the price is what runs): the node
level one of our own (flat.ours()), priced as the largest node (L ranks); the cross-node
level any flat one, MPI's included, priced as N single ranks.

Cost (N nodes of at most L ranks, m bytes): the sum of plan's steps, each the chosen
algorithm's cost() on its level; the point-to-point hand-offs (reducescatter's rows, a
broadcast root's hop to its leader) are left out. The steps:
  allreduce      per chunk of c = m/k: reducescatter of c on the node (t_rs) + allreduce of
                 c/L across (t_x) + allgather of c on the node (t_ag); pipelined,
                   t_rs + t_x + t_ag + (k-1) max(t_rs + t_ag, t_x)
                 (one chunk's steps plus, for every other, its slower side), below
                 MIN_PIPELINED chunks k (t_rs + t_x + t_ag). With ring across: 2(N-1)
                 alpha_x + 2(N-1)/N c/L (L beta_x) a chunk: each rank sends 1/L of a flat
                 ring's bytes across, but the L groups share each node's one link (priced
                 as L beta_x), so the link carries what a node-ordered ring's does; the
                 gain is in steps (N-1 across instead of NL-1) and in the node's work
                 hidden behind the link
  allgather      allgather of m/N on the node + allgather of m across + broadcast of m
  reducescatter  reduce of m to the leader (a reducescatter) + reducescatter of m across
  broadcast      broadcast of m across + broadcast of m on the node
Only on several nodes with more than one rank on some node (math.inf elsewhere, so `auto`
never picks it there; run explicitly, it still works).
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from collectives import kernels
from collectives.algorithms import costmodel
from collectives.algorithms.costmodel import Layout, Params
from collectives.algorithms.flat import FLAT, cheapest, ours
from collectives.ops import ReduceOp
from collectives.runtime import topology
from collectives.runtime.p2p import even_bounds, irecv, isend, offsets
from collectives.runtime.topology import Topology
from collectives.runtime.watchdog import wait_all

TAG_SCATTER, TAG_ROOT = 31, 32
#: The registry runs this module's collectives on the Topology, not on a communicator.
TAKES_TOPOLOGY = True


#: allreduce takes divisor= and divides, inside its own reduction, what each rank reduces
#: (algorithms.reduce folds an Average in that way).
FOLDS_AVERAGE = True

#: An allreduce cuts its buffer into chunks of at least one shard of this size per local
#: rank, so each cross-node message is about this size or larger: large enough that a
#: message's fixed cost is small beside its transfer, small enough that a TCP link keeps
#: its rate (messages of several MiB in flight lose it on shaped links: benchmarks/
#: README.md, "Two-level allreduce against the link").
SHARD_BYTES = 1 << 20
#: At most this many chunks: past it they grow, so the per-chunk hand-offs stay few.
MAX_CHUNKS = 256
#: chunks() takes the most chunks priced within this fraction of the cheapest count.
NEAR = 0.01


def chunks(nbytes: int, layout: Layout, p: Params) -> int:
    """How many chunks an allreduce of nbytes is cut into on layout: of the powers of two up
    to one SHARD_BYTES shard per local rank (and MAX_CHUNKS), the most priced within NEAR
    of the cheapest. The price counts each chunk's fixed costs (across hundreds of nodes,
    a chunk's latencies outweigh what pipelining saves, and few chunks win) but not what a
    message's size does to a TCP flow, which on the rig favoured the most chunks: near-ties
    go to more."""
    most = max(1, min(nbytes // (SHARD_BYTES * max(layout.max_local, 1)), MAX_CHUNKS))
    options = {1 << i for i in range(most.bit_length())} | {most}
    priced = {k: _allreduce_cost(nbytes, layout, p, k) for k in options}
    best = min(priced.values())
    return max(k for k, t in priced.items() if t <= best * (1 + NEAR))


#: Fewest chunks that run pipelined: with fewer, the thread costs more than the overlap
#: saves (benchmarks/README.md, "Two-level allreduce against the link").
MIN_PIPELINED = 4


def overlaps() -> bool:
    """Whether a chunk's cross-node step can run beside the node steps of its neighbours:
    on a thread of its own, which takes MPI_THREAD_MULTIPLE (mpi4py's default) and two CPUs
    for every rank (Topology.cpus_per_rank). On one, the thread's MPI progress loop, which
    polls while it waits, takes turns with the node steps, and the chunks run slower than
    in sequence (benchmarks/README.md, Two-level allreduce against the link). Assumed
    where no job runs (the scale model prices a job to come)."""
    if not MPI.Is_initialized() or not topology.initialized():
        return True
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE and topology.get().cpus_per_rank >= 2


def pipelined(k: int) -> bool:
    """Whether an allreduce of k chunks runs pipelined (else its chunks run in sequence)."""
    return k >= MIN_PIPELINED and overlaps()


def _steps(collective: str, m: int, L: int, N: int) -> dict[str, tuple[str, str, int]]:
    """Each level step of a call of m bytes over N nodes of at most L ranks:
    step -> (flat collective, "intra" or "inter", bytes), as the collectives below run them."""
    return {
        "allreduce": {"intra_rs": ("reducescatter", "intra", m),
                      "inter_ar": ("allreduce", "inter", m // L),
                      "intra_ag": ("allgather", "intra", m)},
        "allgather": {"intra_ag": ("allgather", "intra", m // N),
                      "inter_ag": ("allgather", "inter", m),
                      "intra_bcast": ("broadcast", "intra", m)},
        "reducescatter": {"intra_rs": ("reducescatter", "intra", m),
                          "inter_rs": ("reducescatter", "inter", m)},
        "broadcast": {"inter_bcast": ("broadcast", "inter", m),
                      "intra_bcast": ("broadcast", "intra", m)},
    }[collective]


def plan(collective: str, nbytes: int, layout: Layout,
         p: Params) -> dict[str, tuple[str, Layout, int, str]]:
    """Each step of a hierarchical call of nbytes on layout: step -> (flat collective,
    level layout, bytes, the flat algorithm cheapest there); an allreduce's steps are its
    chunks' (chunks()). The one place a level's algorithm is decided; it depends only on
    values every rank shares, so all ranks of a level run the same algorithm."""
    if collective == "allreduce":
        nbytes //= chunks(nbytes, layout, p)
    return _plan(collective, nbytes, layout, p)


def _plan(collective: str, nbytes: int, layout: Layout,
          p: Params) -> dict[str, tuple[str, Layout, int, str]]:
    levels = {"intra": layout.intra(), "inter": layout.inter()}
    steps = {}
    for step, (flat, level, m) in _steps(collective, nbytes, max(layout.max_local, 1),
                                         max(layout.nodes, 1)).items():
        among = ours() if level == "intra" else tuple(FLAT)
        steps[step] = (flat, levels[level], m, cheapest(
            flat, m, levels[level], _level_params(levels[level], layout, p), among))
    return steps


def _priced(steps: dict[str, tuple[str, Layout, int, str]], layout: Layout,
            p: Params) -> dict[str, float]:
    """step -> predicted seconds of plan's steps."""
    return {step: FLAT[algo].cost(flat, m, where, _level_params(where, layout, p))
            for step, (flat, where, m, algo) in steps.items()}


def _level_params(where: Layout, layout: Layout, p: Params) -> Params:
    """p as a step on level `where` of layout sees it: across nodes, the L groups of one
    rank per node run at once and share each node's one link, so each gets 1/L of its
    bandwidth."""
    if where.nodes == 1:
        return p
    return dataclasses.replace(p, beta_inter=p.beta_inter * max(layout.max_local, 1))


def cost(collective: str, nbytes: int, layout: Layout, p: Params) -> float:
    """Predicted seconds of one call on layout: plan's steps (see the module docstring)."""
    if layout.nodes <= 1 or layout.max_local <= 1:
        return math.inf
    if collective == "allreduce":
        return _allreduce_cost(nbytes, layout, p, chunks(nbytes, layout, p))
    return sum(_priced(_plan(collective, nbytes, layout, p), layout, p).values())


def _allreduce_cost(nbytes: int, layout: Layout, p: Params, k: int) -> float:
    """An allreduce of nbytes in k chunks: pipelined or in sequence (module docstring)."""
    t = _priced(_plan("allreduce", nbytes // k, layout, p), layout, p)
    node, cross = t["intra_rs"] + t["intra_ag"], t["inter_ar"]
    if not pipelined(k):
        return k * (node + cross)
    return node + cross + (k - 1) * max(node, cross)


def _levels(collective: str, nbytes: int, topo: Topology) -> dict[str, Callable]:
    """step -> the flat function plan chose for it on topo."""
    return _functions(plan(collective, nbytes, Layout.of(topo), costmodel.params()))


def _functions(steps: dict[str, tuple[str, Layout, int, str]]) -> dict[str, Callable]:
    """step -> the flat function that runs it."""
    return {step: getattr(FLAT[algo], flat) for step, (flat, _, _, algo) in steps.items()}


def _node_order(topo: Topology) -> list[int]:
    """World ranks in node order (node by node, local rank order)."""
    return [r for node in topo.nodes for r in node]


def allreduce(topo: Topology, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
              dtype: str, divisor: int = 1) -> None:
    """recv = reduction of every rank's send (send may be recv), divided by divisor (an
    Average: each rank divides the part it owns, 1/local_size of the buffer, before the
    intra-node allgather spreads it). Past one chunk, pipelined (see the module docstring)."""
    layout, p = Layout.of(topo), costmodel.params()
    k = chunks(recv.nbytes, layout, p)
    level = _functions(_plan("allreduce", recv.nbytes // k, layout, p))
    topo.shard_comm(0)  # made collectively here, before a thread of ours uses them
    bounds = even_bounds(recv.size, k)
    parts = [_Chunk(topo, send, recv, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    if not pipelined(k):
        for part in parts:
            part.node_reduce(level, op, dtype)
            part.cross(level, op, dtype, divisor)
            part.node_spread(level)
        return
    # the cross-node steps run on a thread of their own, a chunk behind the node steps
    reduced: queue.SimpleQueue = queue.SimpleQueue()  # chunks reduced on the node; None: stop
    crossed: queue.SimpleQueue = queue.SimpleQueue()  # chunks reduced across, or the error

    def across() -> None:
        try:
            while (part := reduced.get()) is not None:
                part.cross(level, op, dtype, divisor)
                crossed.put(part)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            crossed.put(error)

    worker = threading.Thread(target=across, name="collectives-hierarchical", daemon=True)
    worker.start()
    try:
        parts[0].node_reduce(level, op, dtype)
        reduced.put(parts[0])
        for i, part in enumerate(parts):
            if i + 1 < k:
                parts[i + 1].node_reduce(level, op, dtype)
                reduced.put(parts[i + 1])
            done = crossed.get()
            if isinstance(done, BaseException):
                raise done
            part.node_spread(level)
    except BaseException:
        # the thread stops before its next chunk; one stuck in a cross-node step whose
        # peers failed stays there (a daemon) rather than holding the error back
        reduced.put(None)
        raise
    reduced.put(None)
    worker.join()


class _Chunk:
    """One chunk [lo, hi) of an allreduce: its shards, this rank's part of them (the shards
    it owns), and the three steps that reduce it."""

    def __init__(self, topo: Topology, send: np.ndarray, recv: np.ndarray, lo: int, hi: int):
        self.topo, self.send, self.recv = topo, send[lo:hi], recv[lo:hi]
        self.shards = even_bounds(hi - lo, topo.max_local_size)
        self.owned = [s for s in range(topo.max_local_size)
                      if topo.shard_owner(s) == topo.local_rank]
        self.counts = [0] * topo.local_size
        for s in range(topo.max_local_size):
            self.counts[topo.shard_owner(s)] += self.shards[s + 1] - self.shards[s]
        self.mine = self.recv[self.shards[self.owned[0]]:self.shards[self.owned[-1] + 1]]

    def node_reduce(self, level: dict[str, Callable], op: ReduceOp, dtype: str) -> None:
        """1. intra-node reduce-scatter into this rank's part of recv."""
        level["intra_rs"](self.topo.node_comm, self.send, self.mine, self.counts, op, dtype)

    def cross(self, level: dict[str, Callable], op: ReduceOp, dtype: str,
              divisor: int) -> None:
        """2. inter-node allreduce of each owned shard, then an Average's division of it."""
        for s in self.owned:
            comm = self.topo.shard_comm(s)
            piece = self.recv[self.shards[s]:self.shards[s + 1]]
            if comm.Get_size() > 1 and piece.size:
                level["inter_ar"](comm, piece, piece, op, dtype)
        if divisor > 1:
            kernels.divide(self.mine, dtype, divisor)

    def node_spread(self, level: dict[str, Callable]) -> None:
        """3. intra-node allgather of the reduced parts (in place: our node algorithms
        take this rank's own block of recv as its input)."""
        level["intra_ag"](self.topo.node_comm, self.mine, self.recv, self.counts)


def allgather(topo: Topology, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
    """recv = every rank's send in world rank order."""
    level = _levels("allgather", recv.nbytes, topo)
    node_counts = [[counts[r] for r in node] for node in topo.nodes]
    mine = node_counts[topo.node_index]
    node_block = np.empty(sum(mine), dtype=send.dtype)
    level["intra_ag"](topo.node_comm, send, node_block, mine)
    if topo.local_rank == 0:
        gathered = np.empty_like(recv)
        level["inter_ag"](topo.cross_comm, node_block, gathered, [sum(c) for c in node_counts])
        _to_world_order(topo, gathered, recv, counts)
    level["intra_bcast"](topo.node_comm, recv, 0)


def _to_world_order(topo: Topology, node_ordered: np.ndarray, out: np.ndarray,
                    counts: list[int]) -> None:
    order = _node_order(topo)
    if order == list(range(topo.size)):
        out[...] = node_ordered
        return
    world = offsets(counts)
    pos = 0
    for r in order:
        out[world[r]:world[r + 1]] = node_ordered[pos:pos + counts[r]]
        pos += counts[r]


def _from_world_order(topo: Topology, buf: np.ndarray, counts: list[int]) -> np.ndarray:
    order = _node_order(topo)
    if order == list(range(topo.size)):
        return buf
    world = offsets(counts)
    return np.concatenate([buf[world[r]:world[r + 1]] for r in order])


def reducescatter(topo: Topology, send: np.ndarray, recv: np.ndarray, counts: list[int],
                  op: ReduceOp, dtype: str) -> None:
    """recv = this rank's block of the reduction of every send."""
    level = _levels("reducescatter", send.nbytes, topo)
    leader = topo.local_rank == 0
    node_sum = np.empty(send.size if leader else 0, dtype=send.dtype)
    # 1. reduce the whole buffer onto the node leader (a reduce-scatter with one owner)
    level["intra_rs"](topo.node_comm, send, node_sum, [send.size] + [0] * (topo.local_size - 1),
                       op, dtype)
    if leader:
        # 2. leaders reduce-scatter node-sized blocks
        node_counts = [sum(counts[r] for r in node) for node in topo.nodes]
        mine = np.empty(node_counts[topo.node_index], dtype=send.dtype)
        level["inter_rs"](topo.cross_comm, _from_world_order(topo, node_sum, counts), mine,
                           node_counts, op, dtype)
        # 3. hand each local rank its rows
        offs = offsets([counts[r] for r in topo.nodes[topo.node_index]])
        reqs = [isend(topo.node_comm, mine[offs[j]:offs[j + 1]], j, TAG_SCATTER)
                for j in range(1, topo.local_size)]
        recv[...] = mine[offs[0]:offs[1]]
        wait_all(topo.node_comm, reqs, "hierarchical")
    else:
        wait_all(topo.node_comm, [irecv(topo.node_comm, recv, 0, TAG_SCATTER)], "hierarchical")


def broadcast(topo: Topology, buf: np.ndarray, root: int) -> None:
    """buf on every rank = buf on world rank root."""
    level = _levels("broadcast", buf.nbytes, topo)
    root_node = next(i for i, node in enumerate(topo.nodes) if root in node)
    root_leader = topo.nodes[root_node][0]
    if root != root_leader:  # bring the data to the root node's leader
        if topo.rank == root:
            wait_all(topo.comm, [isend(topo.comm, buf, root_leader, TAG_ROOT)], "hierarchical")
        elif topo.rank == root_leader:
            wait_all(topo.comm, [irecv(topo.comm, buf, root, TAG_ROOT)], "hierarchical")
    if topo.local_rank == 0:
        level["inter_bcast"](topo.cross_comm, buf, root_node)
    level["intra_bcast"](topo.node_comm, buf, 0)
