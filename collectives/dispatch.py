"""Runs a named algorithm: the table from algorithm names to the functions in
collectives/algorithms/, and the wiring of hierarchical's intra- and inter-node levels."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from . import kernels, select
from .algorithms import hierarchical, mpi, ring, shm, tree
from .ops import ReduceOp, kernel_op
from .topology import Topology

#: The algorithm names a caller may pass.
ALGORITHMS = ("auto", "ring", "tree", "hierarchical", "shm", "mpi")
FLAT = ("ring", "tree", "mpi", "shm")


@functools.cache
def _table(seg: int) -> dict[str, dict[str, Callable]]:
    return {
        "allreduce": {"ring": functools.partial(ring.allreduce, segment_bytes=seg),
                      "tree": tree.allreduce, "mpi": mpi.allreduce, "shm": shm.allreduce},
        "reducescatter": {"ring": functools.partial(ring.reducescatter, segment_bytes=seg),
                          "tree": tree.reducescatter, "mpi": mpi.reducescatter,
                          "shm": shm.reducescatter},
        "allgather": {"ring": ring.allgather, "tree": tree.allgather, "mpi": mpi.allgather,
                      "shm": shm.allgather},
        "broadcast": {"ring": functools.partial(ring.broadcast, segment_bytes=seg),
                      "tree": tree.broadcast, "mpi": mpi.broadcast, "shm": shm.broadcast},
    }


def _flat(topo: Topology, collective: str, algo: str) -> Callable:
    return _table(topo.config.ring_segment_bytes)[collective][algo]


def _level(collective: str, level: str, topo: Topology, nbytes: int) -> Callable:
    """The flat algorithm for one level ("intra" or "inter") of a hierarchical call."""
    return _flat(topo, collective, select.choose_level(collective, level, nbytes, topo))


def check_shm(algo: str, topo: Topology) -> None:
    """shm on the world communicator needs every rank on one node."""
    if algo == "shm" and len(topo.nodes) > 1:
        raise ValueError(f"algorithm: 'shm' needs every rank on one node, but the job spans "
                         f"{len(topo.nodes)} nodes; use 'hierarchical' (its node level uses "
                         f"shared memory) or 'auto'")


def allreduce(algo: str, topo: Topology, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
              dtype: str) -> None:
    if algo in FLAT:
        return _flat(topo, "allreduce", algo)(topo.comm, send, recv, op, dtype)
    nbytes = recv.nbytes
    shard = nbytes // max(topo.max_local_size, 1)
    hierarchical.allreduce(topo, send, recv, op, dtype,
                           intra_rs=_level("reducescatter", "intra", topo, nbytes),
                           intra_ag=_level("allgather", "intra", topo, nbytes),
                           inter_ar=_level("allreduce", "inter", topo, shard))


def reduce(algo: str, topo: Topology, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
           dtype: str) -> None:
    """recv = op over every rank's send (send may be recv), Average included: the data
    moves as a Sum and is divided once at the end (floor division for integers)."""
    allreduce(algo, topo, send, recv, kernel_op(op), dtype)
    average(recv, dtype, op, topo.size)


def average(out: np.ndarray, dtype: str, op: ReduceOp, n: int) -> None:
    """Finish an Average over n ranks that moved as a Sum: one division (floor division
    for integers); nothing for the other ops."""
    if op is ReduceOp.Average and n > 1:
        kernels.divide(out, dtype, n)


def reducescatter(algo: str, topo: Topology, send: np.ndarray, recv: np.ndarray,
                  counts: list[int], op: ReduceOp, dtype: str) -> None:
    if algo in FLAT:
        return _flat(topo, "reducescatter", algo)(topo.comm, send, recv, counts, op, dtype)
    nbytes = send.nbytes
    hierarchical.reducescatter(topo, send, recv, counts, op, dtype,
                               intra_rs=_level("reducescatter", "intra", topo, nbytes),
                               inter_rs=_level("reducescatter", "inter", topo, nbytes))


def allgather(algo: str, topo: Topology, send: np.ndarray, recv: np.ndarray,
              counts: list[int]) -> None:
    if algo in FLAT:
        return _flat(topo, "allgather", algo)(topo.comm, send, recv, counts)
    nbytes = recv.nbytes
    hierarchical.allgather(topo, send, recv, counts,
                           intra_ag=_level("allgather", "intra", topo, nbytes),
                           inter_ag=_level("allgather", "inter", topo, nbytes),
                           intra_bcast=_level("broadcast", "intra", topo, nbytes))


def broadcast(algo: str, topo: Topology, buf: np.ndarray, root: int) -> None:
    if algo in FLAT:
        return _flat(topo, "broadcast", algo)(topo.comm, buf, root)
    nbytes = buf.nbytes
    hierarchical.broadcast(topo, buf, root,
                           intra_bcast=_level("broadcast", "intra", topo, nbytes),
                           inter_bcast=_level("broadcast", "inter", topo, nbytes))
