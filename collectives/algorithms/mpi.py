"""The MPI library's own collectives: the reference our algorithms are measured against,
and the fallback.

Native MPI types and ops are used where MPI has them; float16 and bfloat16 (which MPI does
not define) travel as 16-bit integers with a user-defined op that calls our kernels. So do
int8, uint8 and int16: Open MPI's AVX reduction saturates 8- and 16-bit sums on overflow
where C and NumPy wrap (open-mpi/ompi#8045, closed as wontfix; int16 sums out of range
come back saturated too), so its native narrow Sum disagrees with every other
algorithm. And so do float Min/Max: MPI's MIN/MAX drop a NaN depending on operand
order, where ours propagate it (as numpy.minimum), so `auto` switching algorithms by size
never changes an answer.
Average is a Sum here too: the caller divides once.

Cost, as cost() computes it: the library picks among algorithms like ours and runs their
steps in C, so the best of ring's and tree's formulas with no per-message overhead (o = 0),
plus one mpi_call of fixed cost; alltoall: pairwise exchange's formula the same way. Its
allreduce has one more: Rabenseifner's, which coll/tuned's fixed rules pick for commutative
ops past a few KiB at most group sizes (at 4 ranks from 8 KiB): a recursive-halving
reduce-scatter and a recursive-doubling allgather among the largest power of two q <= n,
the e = n - q extra ranks folded in and served at the end,
  2 log2 q alpha + 2 (q-1)/q m beta + (q-1)/q m gamma + [e>0] (3 alpha + 2 m beta + m/2 gamma)
ring's bandwidth in 2 log2 q steps instead of 2 (n-1); with extra ranks the fold's 2 m beta
leaves large messages to ring.

An allreduce over several nodes with several ranks on some node may also run in two levels:
Open MPI 5's coll/han takes precedence over coll/tuned by default (`ompi_info`: priority 35
against 30). Segment by segment it reduces inside each node to a leader, reduces and
broadcasts among the leaders with libnbc's non-blocking collectives, and broadcasts inside
the node. Priced as the better of a flat allreduce (a node layout the library does not
see, as simulated nodes, runs flat) and a binomial reduce and broadcast of m on the largest
node plus the best flat allreduce of m across one rank per node. Between 2 leaders a
reduce and a broadcast move what an allreduce does, so there this price follows the
library's time where a flat ring's would not (the rig's 2x2 rows in benchmarks/README.md,
The model against the rig). Between more, libnbc's
broadcast goes linear up to 4 leaders and binomial above, so its root sends each segment
N-1 or log2 N times where an allreduce sends 2 (N-1)/N: there the price is a lower bound
on the library's time, not measured."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from mpi4py import MPI

from collectives import kernels
from collectives.algorithms import pairwise, ring, tree
from collectives.algorithms.costmodel import Layout, Params
from collectives.dtypes import FLOATING, STORAGE
from collectives.ops import ReduceOp
from collectives.runtime.p2p import count, message, offsets

#: Elements per MPI call: MPI 3.1 counts are C ints.
MAX_COUNT = 1 << 30

_NATIVE_TYPES = {
    "float32": MPI.FLOAT, "float64": MPI.DOUBLE, "int32": MPI.INT32_T, "int64": MPI.INT64_T,
}
_CARRIER_TYPES = {2: MPI.UINT16_T, 1: MPI.UINT8_T}
_NATIVE_OPS = {ReduceOp.Sum: MPI.SUM, ReduceOp.Min: MPI.MIN, ReduceOp.Max: MPI.MAX,
               ReduceOp.Product: MPI.PROD}


@functools.cache
def _user_op(dtype: str, op: ReduceOp) -> MPI.Op:
    storage = STORAGE[dtype]

    def fold(inbuf, inoutbuf, datatype) -> None:
        src = np.frombuffer(inbuf, dtype=storage)
        dst = np.frombuffer(inoutbuf, dtype=storage)
        kernels.reduce(dst, [dst, src], dtype, op)

    return MPI.Op.Create(fold, commute=True)


def _type_and_op(dtype: str, op: ReduceOp) -> tuple[MPI.Datatype, MPI.Op]:
    nan_aware = dtype in FLOATING and op in (ReduceOp.Min, ReduceOp.Max)
    if dtype in _NATIVE_TYPES and not nan_aware:
        return _NATIVE_TYPES[dtype], _NATIVE_OPS[op]
    if dtype in _NATIVE_TYPES:
        return _NATIVE_TYPES[dtype], _user_op(dtype, op)
    return _CARRIER_TYPES[STORAGE[dtype].itemsize], _user_op(dtype, op)


def allreduce(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
              dtype: str) -> None:
    count(comm, recv.nbytes, recv.nbytes)
    datatype, mpi_op = _type_and_op(dtype, op)
    for lo in range(0, max(recv.size, 1), MAX_COUNT):  # MPI counts are C ints
        hi = min(lo + MAX_COUNT, recv.size)
        source = MPI.IN_PLACE if send is recv else [send[lo:hi], datatype]
        comm.Allreduce(source, [recv[lo:hi], datatype], mpi_op)


def reducescatter(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, counts: list[int],
                  op: ReduceOp, dtype: str) -> None:
    count(comm, send.nbytes - recv.nbytes, recv.nbytes)
    datatype, mpi_op = _type_and_op(dtype, op)
    if sum(counts) * send.itemsize < 1 << 31:
        comm.Reduce_scatter([send, datatype], [recv, datatype], list(counts), mpi_op)
        return
    # in rounds: round k reduces elements [k*C, (k+1)*C) of every rank's block
    starts = offsets(counts)
    step = MAX_COUNT // len(counts)
    r = comm.Get_rank()
    for lo in range(0, max(counts), step):
        part = [max(0, min(c, lo + step) - lo) for c in counts]
        packed = np.concatenate([send[starts[i] + lo:starts[i] + lo + part[i]]
                                 for i in range(len(counts))])
        comm.Reduce_scatter([packed, datatype], [recv[lo:lo + part[r]], datatype], part, mpi_op)


def allgather(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
    count(comm, send.nbytes, recv.nbytes - send.nbytes)
    item = send.itemsize
    nbytes = [c * item for c in counts]
    if recv.nbytes < 1 << 31:
        displs = offsets(nbytes)[:-1]
        comm.Allgatherv([send, MPI.BYTE], [recv, (nbytes, displs), MPI.BYTE])
        return
    # byte displacements past 2 GiB do not fit C ints: every rank broadcasts its own block
    starts = offsets(counts)
    recv[starts[comm.Get_rank()]:starts[comm.Get_rank() + 1]] = send
    for root in range(comm.Get_size()):
        broadcast(comm, recv[starts[root]:starts[root + 1]], root)


def broadcast(comm: MPI.Comm, buf: np.ndarray, root: int) -> None:
    root_here = comm.Get_rank() == root
    count(comm, buf.nbytes if root_here else 0, 0 if root_here else buf.nbytes)
    comm.Bcast(message(buf), root=root)


def alltoall(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, send_counts: list[int],
             recv_counts: list[int]) -> None:
    """MPI_Alltoallv of bytes; past 2 GiB (displacements are C ints) pairwise.alltoall,
    whose messages count themselves."""
    if max(send.nbytes, recv.nbytes) >= 1 << 31:
        pairwise.alltoall(comm, send, recv, send_counts, recv_counts)
        return
    r = comm.Get_rank()
    count(comm, send.nbytes - send_counts[r] * send.itemsize,
          recv.nbytes - recv_counts[r] * recv.itemsize)
    sb, rb = ([c * send.itemsize for c in counts] for counts in (send_counts, recv_counts))
    comm.Alltoallv([send, (sb, offsets(sb)[:-1]), MPI.BYTE],
                   [recv, (rb, offsets(rb)[:-1]), MPI.BYTE])


def cost(collective: str, nbytes: int, layout: Layout, p: Params) -> float:
    """Predicted seconds of one call on layout (see the module docstring)."""
    if layout.size <= 1:
        return 0.0
    in_c = dataclasses.replace(p, overhead=0.0)
    if collective == "alltoall":  # pairwise, as the library does it, steps in C
        return pairwise.cost(collective, nbytes, layout, in_c) + p.mpi_call

    def flat(on: Layout) -> float:
        best = min(ring.cost(collective, nbytes, on, in_c), tree.cost(collective, nbytes, on, in_c))
        return min(best, _halving_doubling(nbytes, on, in_c)) if collective == "allreduce" else best

    best = flat(layout)
    if collective == "allreduce" and layout.nodes > 1 and layout.max_local > 1:
        node_reduce_and_broadcast = 2 * tree.cost("broadcast", nbytes, layout.intra(), in_c) \
            + nbytes * p.gamma
        best = min(best, node_reduce_and_broadcast + flat(layout.inter()))
    return best + p.mpi_call


def _halving_doubling(nbytes: int, layout: Layout, p: Params) -> float:
    """Rabenseifner's allreduce of nbytes on layout (the module docstring's formula)."""
    m = nbytes
    q, extra = tree.fold_shape(layout.size)
    alpha, beta = layout.message(p)
    share = (q - 1) / q * m
    folded = 3 * alpha + 2 * m * beta + m / 2 * p.gamma if extra else 0.0
    return 2 * (q.bit_length() - 1) * alpha + 2 * share * beta + share * p.gamma + folded
