"""Shared-memory collectives for ranks that share a node: allreduce, reducescatter,
allgather and broadcast through one shared window per communicator
(collectives/runtime/window.py: per-rank counters and staging buffers).

How it works. Every rank owns a segment of the communicator's window, kept across calls on
the communicator itself (grown on demand, collectively; freed with the communicator or by
`shutdown`), holding DEPTH staging buffers of up
to slot_limit() bytes. A call is cut into chunks; chunk g (numbered across calls) uses
buffer g % DEPTH. The data is cut into one block per rank, and each chunk takes one piece
of every block:
  reducescatter  1. copy-in: every rank copies its pieces of the other ranks' blocks into its
                    buffer, then bumps READY; 2. reduce: rank r folds piece r of every rank's
                    buffer (its own straight from its input), in rank order, into its output
                    in one C++ pass, then bumps DONE.
  allreduce      the same over even blocks, but step 2 leaves piece r in r's own buffer (and
                 copies it to r's output while it is hot) and bumps REDUCED; 3. copy-out:
                 every rank copies every other rank's piece into its output.
  allgather      1. copy a piece of the input into the buffer (and into the own output
                 block); 2. copy every other rank's piece out.
  broadcast      1. the root copies a piece in; 2. the others copy it out.
These pipelined stages run in C++ with the GIL released (csrc/runtime/shm.cpp); an
allreduce described before runs them from the API's C++ fast entry (allreduce_pipeline(),
_C.FastAllreduce: csrc/runtime/fast_allreduce.cpp), with no Python between the call and its
result.
Calls staging at most SMALL_BYTES in all take one chunk in one step (the single-step path):
every rank copies its whole input in, waits once, and reads what it needs from every
rank's buffer (allreduce: every rank folds the whole vector; reducescatter its block;
allgather copies every block out; csrc/runtime/shm.cpp's shm_single). An
allreduce called through the API on one node takes that step inside its agreement instead
(collectives/runtime/agreement.py: the call's header rides beside its data), so it has no step of
its own there; hierarchical's node level calls allreduce() here directly.
Before writing buffer g % DEPTH a rank waits until every rank has counted chunk g - DEPTH
as DONE. Stage s of chunk k runs at step k + s, so each wait is on work the others did a
step earlier, and chunks stay in cache from copy-in to copy-out. Every element is folded
once, in rank order, so all ranks get bit-identical results.

Stores. A pipelined reduction writes its chunks into the buffers with plain stores, which
leave them in this core's cache for the other ranks to read, or with streaming stores, which
send them to memory first; the window keeps timing large calls each way, per kind of call
(size, in or out of place, Average), and runs the faster (StoreChoice in
csrc/runtime/shm.h). Which is faster follows the machine, not the call: where
the ranks' cores share a cache, plain stores; where they do not, reading a line another core
has just modified costs several times a read from memory. A VM's vCPUs can move between
the two within one job (benchmarks/README.md, "Average and in place"). Streaming, an
allreduce folds each piece in a scratch buffer and streams it to its own buffer. A large
allreduce (8 MiB and up) streams its result too where it is out of place, whose lines no
cache holds, or while the buffers stream.

A wait longer than the communicator's stall timeout means a rank has left the collective:
it raises (None: wait forever, as the rest of the library does). The timeout is the
Topology's (Topology.set_timeout, torch's timeout=), read as each wait starts; on a
communicator no Topology runs on, Config.stall_timeout_s when the window was made.

Cost per rank for L ranks and m bytes (w = one counter wait, about a microsecond; copies and
folds run at memory speed; waits overlap work across the pipeline):
  allreduce      copy in (L-1)/L m, fold m/L (reading m), copy out m; 3 w per chunk. Memory
                 traffic ~2m (input read, output written; +m read-for-ownership when recv is
                 not send), against 5-11 m for a message-passing ring.
  single step    copy in the whole input; allreduce folds L m, reducescatter m, allgather
                 copies m out; 1 w in all (plus the wait for a free buffer, DEPTH calls back).
  reducescatter  copy in (L-1)/L m, fold m/L; 2 w per chunk.
  allgather      copy in 2 m/L (window and own block), copy out (L-1)/L m (m = gathered).
  broadcast      root copies m in, the others m out; 2 w per chunk.
cost() prices a call as 3 (alpha + o) per chunk of SLOT_BYTES (at least one) plus passes x m
x gamma, where passes counts what one rank copies or folds, in buffers of m (a copy of a
byte moves memory about as fast as our kernels reduce one): allreduce 3 (L-1)/L (copy in,
fold, copy out), reducescatter 2 (L-1)/L (copy in, fold), allgather (L+1)/L (copy in 2/L,
copy out (L-1)/L), broadcast 1 (in on the root, out on the others, at once); math.inf on a
group that spans several nodes. An allreduce riding in the agreement is priced by
select.agreement_cost.
"""

from __future__ import annotations

import math
import os

import numpy as np
from mpi4py import MPI

from collectives import config, kernels
from collectives.algorithms.costmodel import Layout, Params
from collectives.ops import ReduceOp
from collectives.runtime.p2p import count, even_bounds, offsets
from collectives.runtime.watchdog import limit_of
from collectives.runtime.window import Window, ranks_on_machine, shares_memory

#: Largest staging buffer per rank and chunk where every rank has a core of its own: chunks
#: that stay in the L2 cache, small enough that a 1 MiB allreduce at np 2 already has two
#: to pipeline (copying one in while the other is folded). With more ranks than cores a
#: wait may cost a context switch, which outweighs the overlap, so fewer chunks win there:
#: buffers of twice this. See slot_limit().
SLOT_BYTES = 512 << 10
#: Smallest buffer allocated, so that small calls do not regrow the window one by one.
MIN_SLOT_BYTES = 64 << 10
#: Staging buffers per rank: at least the deepest pipeline (3 stages) so no rank waits on
#: itself, plus one so a rank can copy in while a slow peer still reads.
DEPTH = 4
#: Calls staging at most this many bytes in all (every rank's whole input) take one chunk:
#: one wait instead of two or three, at the price of copying whole inputs in.
SMALL_BYTES = 256 << 10
_ALIGN = 64  # pieces start on cache lines


_keyval: int | None = None  # the attribute holding a communicator's window: created on first
                            # use (MPI must be initialized)


#: allreduce takes divisor= and divides, inside its own reduction, what each rank reduces
#: (algorithms.reduce folds an Average in that way).
FOLDS_AVERAGE = True

def _window(comm: MPI.Comm, slot_bytes: int) -> Window:
    """comm's window with buffers of at least slot_bytes; creating or growing it is
    collective, and every rank asks for the same size because sizes are agreed."""
    w = window_of(comm)
    if w is not None and w.slot_bytes >= slot_bytes:
        return w
    if w is None:
        _check_shared(comm)
        grown = max(slot_bytes, MIN_SLOT_BYTES)
    else:
        comm.Barrier()  # no rank still reads the old window
        comm.Delete_attr(_key())  # frees it
        grown = max(slot_bytes, min(2 * w.slot_bytes, slot_limit(comm.Get_size())))
    timeout = config.get().stall_timeout_s
    limit = limit_of(comm)  # a Topology's communicator: its timeout, as it is when a wait starts
    w = Window(comm, -(-grown // _ALIGN) * _ALIGN, DEPTH, math.inf if timeout is None else timeout,
               None if limit is None else limit.native)
    if config.get().frozen:  # a reproducible run: no store choice (plain, as a kind's first)
        w.native.set_stores(0)
    comm.Set_attr(_key(), w)
    return w


def window_of(comm: MPI.Comm) -> Window | None:
    """comm's window, if it has one. The communicator holds it (an MPI attribute: MPI
    reuses no handle while comm lives), so its owner (comm's Topology, or whoever made comm)
    owns the window too, and freeing comm frees it."""
    return None if _keyval is None else comm.Get_attr(_keyval)


def _key() -> int:
    global _keyval
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval(delete_fn=lambda _comm, _key, w: w.free())
    return _keyval


def _check_shared(comm: MPI.Comm) -> None:
    if not shares_memory(comm):
        raise ValueError("shm: the ranks of comm do not all share memory; pass the node "
                         "communicator")


def shutdown(comm: MPI.Comm) -> None:
    """Free comm's window now, if it has one (collective over comm); the next call makes a
    new one. Freeing comm frees it too."""
    if window_of(comm) is not None:
        comm.Delete_attr(_key())


def stores(comm: MPI.Comm) -> dict[str, tuple[int, int, int]]:
    """How comm's window stored its large reductions, per kind of call (StoreChoice in
    csrc/runtime/shm.h): calls with plain stores, calls with streaming stores, trials of
    the way not running. Empty where comm has no window. For diagnosis: bandwidth.py
    --json keeps the job's."""
    w = window_of(comm)
    if w is None:
        return {}
    return {f"{'allreduce' if allreduce else 'reducescatter'} {lo}-{2 * lo - 1} B "
            f"{'in place' if inplace else 'out of place'}{' Average' if average else ''}": counts
            for (lo, allreduce, inplace, average), counts in w.native.stores().items()}


def check(layout: Layout) -> None:
    """shm needs every rank of the group on one node."""
    if layout.nodes > 1:
        raise ValueError(f"algorithm: 'shm' needs every rank on one node, but the job spans "
                         f"{layout.nodes} nodes; use 'hierarchical' (its node level uses "
                         f"shared memory) or 'auto'")


def cost(collective: str, nbytes: int, layout: Layout, p: Params) -> float:
    """Predicted seconds of one call on layout (see the module docstring)."""
    if layout.nodes > 1:
        return math.inf
    if layout.size <= 1:
        return 0.0
    step, _ = layout.message(p)
    L = layout.size
    passes = {"allreduce": 3 * (L - 1) / L, "reducescatter": 2 * (L - 1) / L,
              "allgather": (L + 1) / L, "broadcast": 1.0}[collective]
    chunks = max(1, nbytes // SLOT_BYTES)
    return 3 * chunks * step + passes * nbytes * p.gamma


# ------------------------------------------------------------------------------- plumbing

def slot_limit(size: int) -> int:
    """The largest staging buffer for a group of size ranks on this machine: SLOT_BYTES,
    twice that when the machine runs more ranks than it has cores. Every rank of the
    group must get the same, so it counts the machine's cores (not this process's
    affinity, which a launcher may set per rank)."""
    return SLOT_BYTES if ranks_on_machine(size) <= (os.cpu_count() or 1) else 2 * SLOT_BYTES


def _piece_elems(longest: int, pieces: int, itemsize: int, size: int) -> int:
    """Elements per piece so that `pieces` pieces fit a buffer of slot_limit(size) bytes,
    cache-line aligned."""
    per = max(slot_limit(size) // pieces // itemsize // _ALIGN * _ALIGN, _ALIGN)
    return min(longest, per)


def _reduce_single(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, lo: int, hi: int,
                   op: ReduceOp, dtype: str, divisor: int = 1) -> None:
    """recv = elements [lo, hi) of the reduction of every rank's send, in one step (every
    rank folds them from every rank's buffer, in C++: csrc/runtime/shm.cpp), divided by
    divisor (the call is small: its result is still in cache)."""
    kernels.shm_reduce_single(_window(comm, send.nbytes).native, send, recv, lo, hi, dtype, op)
    if divisor > 1:
        kernels.divide(recv, dtype, divisor)


class _Blocks:
    """A buffer cut into one block per rank (bounds) and each block into pieces of e
    (piece k of block j: csrc/runtime/shm.cpp)."""

    __slots__ = ("bounds", "e", "nchunks")

    def __init__(self, bounds: list[int], e: int):
        self.bounds, self.e = bounds, e
        longest = max(bounds[j + 1] - bounds[j] for j in range(len(bounds) - 1))
        self.nchunks = -(-longest // e)


# ------------------------------------------------------------------ reduce over blocks

def _reduce_blocks(w: Window, blocks: _Blocks, send: np.ndarray, recv: np.ndarray,
                   op: ReduceOp, dtype: str, allreduce: bool, divisor: int = 1) -> None:
    """The pipelined stages (copy-in, reduce, and for allreduce copy-out) of every chunk,
    in C++ with the GIL released (csrc/runtime/shm.cpp; same counters and order as above);
    the reduce stage divides its pieces by divisor."""
    kernels.shm_reduce(w.native, send, recv, blocks.bounds, blocks.e, blocks.nchunks, dtype, op,
                       allreduce, divisor)


def _allreduce_blocks(size: int, elems: int, itemsize: int) -> _Blocks | None:
    """How allreduce cuts elems elements of itemsize bytes over size ranks for the
    pipeline, or None where it takes no pipeline (one rank, nothing, or the single step)."""
    if size == 1 or elems == 0 or elems * itemsize * size <= SMALL_BYTES:
        return None
    bounds = even_bounds(elems, size)
    return _Blocks(bounds, _piece_elems(bounds[1], size, itemsize, size))


def allreduce(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
              dtype: str, divisor: int = 1) -> None:
    """recv = reduction of every rank's send (send may be recv), divided by divisor (an
    Average: each rank divides the pieces it folds, in the same stage)."""
    count(comm, recv.nbytes, recv.nbytes)
    size = comm.Get_size()
    if size == 1 or recv.size == 0:
        if recv is not send:
            np.copyto(recv, send)
        return
    blocks = _allreduce_blocks(size, recv.size, recv.itemsize)
    if blocks is None:  # every rank folds the whole vector
        return _reduce_single(comm, send, recv, 0, recv.size, op, dtype, divisor)
    w = _window(comm, size * blocks.e * recv.itemsize)
    _reduce_blocks(w, blocks, send, recv, op, dtype, allreduce=True, divisor=divisor)


def has_fast_entry(algorithm: str, shared_channel: bool) -> bool:
    """Whether an allreduce by algorithm can run whole in C++ after the agreement (the fast
    entry, csrc/runtime/fast_allreduce.cpp): shm's pipeline, where the agreement runs in a
    shared window. (The calls that ride in the agreement have one too, whatever runs them.)"""
    return algorithm == "shm" and shared_channel


def allreduce_pipeline(comm: MPI.Comm, elems: int, itemsize: int) -> tuple | None:
    """What a C++ caller needs to run allreduce()'s pipeline on elems elements of itemsize
    bytes itself (_C.FastAllreduce: csrc/runtime/fast_allreduce.cpp): (bounds, e, nchunks, window),
    window() returning the native window, made or grown as allreduce() would (collective:
    call it where allreduce() would run). None where allreduce() takes no pipeline."""
    size = comm.Get_size()
    blocks = _allreduce_blocks(size, elems, itemsize)
    if blocks is None:
        return None
    slot_bytes = size * blocks.e * itemsize
    return blocks.bounds, blocks.e, blocks.nchunks, lambda: _window(comm, slot_bytes).native


def _nothing_to_move(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, total: int) -> bool:
    """Whether the call is over before any window: alone (recv = send, copied here) or with
    no elements (total) to move."""
    if comm.Get_size() == 1:
        np.copyto(recv, send)
        return True
    return total == 0


def reducescatter(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, counts: list[int],
                  op: ReduceOp, dtype: str) -> None:
    """recv = this rank's block (counts[rank] elements) of the reduction of every send."""
    count(comm, send.nbytes - recv.nbytes, recv.nbytes)
    if _nothing_to_move(comm, send, recv, send.size):
        return
    size, r = comm.Get_size(), comm.Get_rank()
    bounds = offsets(counts)
    start, end = bounds[r], bounds[r + 1]
    if send.nbytes * size <= SMALL_BYTES:
        return _reduce_single(comm, send, recv, start, end, op, dtype)
    blocks = _Blocks(bounds, _piece_elems(max(counts), size, send.itemsize, size))
    w = _window(comm, size * blocks.e * send.itemsize)
    _reduce_blocks(w, blocks, send, recv, op, dtype, allreduce=False)


# ------------------------------------------------------------------------ pure copies

def allgather(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
    """recv = every rank's send concatenated in rank order (counts[i] elements from rank i);
    send may be this rank's own block of recv (in place: hierarchical's node level)."""
    count(comm, send.nbytes, recv.nbytes - send.nbytes)
    if _nothing_to_move(comm, send, recv, recv.size):
        return
    size = comm.Get_size()
    bounds = offsets(counts)
    if recv.nbytes <= SMALL_BYTES:  # one step: every rank copies every block out
        w = _window(comm, max(counts) * send.itemsize)
        kernels.shm_allgather_single(w.native, send, recv, bounds)
        return
    blocks = _Blocks(bounds, _piece_elems(max(counts), 1, send.itemsize, size))
    w = _window(comm, blocks.e * send.itemsize)
    kernels.shm_allgather(w.native, send, recv, bounds, blocks.e, blocks.nchunks)


def broadcast(comm: MPI.Comm, buf: np.ndarray, root: int) -> None:
    """buf on every rank = buf on root: the root copies pieces in, the others copy them out."""
    root_here = comm.Get_rank() == root
    count(comm, buf.nbytes if root_here else 0, 0 if root_here else buf.nbytes)
    if comm.Get_size() == 1 or buf.size == 0:
        return
    raw = buf.view(np.uint8)
    e = min(raw.size, slot_limit(comm.Get_size()))
    nchunks = -(-raw.size // e)
    w = _window(comm, e)
    kernels.shm_broadcast(w.native, raw, e, nchunks, root)
