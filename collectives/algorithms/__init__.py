"""The algorithm registry, and the one place that runs algorithm X for collective Y.

Every module listed in REGISTRY provides, as plain functions, the collectives it runs:
  allreduce(comm, send, recv, op, dtype)            recv = reduction of every send
      (a module that sets FOLDS_AVERAGE = True also takes divisor=: an Average's division,
      made by each rank on what it reduces, inside the reduction)
  reducescatter(comm, send, recv, counts, op, dtype) recv = this rank's block of it
  allgather(comm, send, recv, counts)               recv = every send in rank order
  broadcast(comm, buf, root)                        buf = root's buf
  alltoall(comm, send, recv, send_counts, recv_counts)
                                                    recv = block r of every send
(all of the first four, or only alltoall), and
  cost(collective, nbytes, layout, params) -> float  predicted seconds on a group of that
      Layout (collectives/algorithms/costmodel.py), the formula its docstring states; math.inf where
      `auto` must not pick it
and optionally check(layout), which raises ValueError where the algorithm cannot run at all.
comm is a communicator over flat host arrays, except for a module that sets
TAKES_TOPOLOGY = True (hierarchical): its collectives take the Topology in its place.
Adding an algorithm is one new module and one entry in REGISTRY (flat.FLAT for a
flat one).

The algorithms layer: one module per algorithm with its cost() beside it (ring, tree,
shm, mpi, pairwise, hierarchical; flat lists the one-level ones; onebit is the 1-bit
compressed allreduce's exchange), and costmodel (the alpha-beta parameters and Layout).
May import: the leaves, kernels, runtime."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import numpy as np

from collectives import kernels
from collectives.algorithms import flat, hierarchical, pairwise
from collectives.algorithms.costmodel import Layout, Params
from collectives.dtypes import CODES
from collectives.ops import KERNEL_OP, ReduceOp
from collectives.runtime.engine import ENGINE, contributors
from collectives.runtime.topology import Topology

#: Every algorithm by name: the flat ones (flat.py), then the two-level one; a tie in cost
#: goes to the earlier one.
REGISTRY: dict[str, ModuleType] = {**flat.FLAT, "hierarchical": hierarchical,
                                   "pairwise": pairwise}


def names(collective: str) -> tuple[str, ...]:
    """The algorithm names a caller may pass for collective: `auto` and the modules that
    run it."""
    return ("auto", *(name for name, m in REGISTRY.items() if hasattr(m, collective)))


#: The algorithm names a caller may pass to allreduce, allgather, reducescatter, broadcast.
ALGORITHMS = names("allreduce")
#: ... and to alltoall.
ALLTOALL_ALGORITHMS = names("alltoall")


def costs(collective: str, nbytes: int, layout: Layout, p: Params) -> dict[str, float]:
    """Predicted seconds of every registered algorithm that may run this call on layout."""
    found = {name: m.cost(collective, nbytes, layout, p) for name, m in REGISTRY.items()
             if hasattr(m, collective)}
    return {name: t for name, t in found.items() if t < math.inf}


def function(algo: str, collective: str) -> Callable:
    """Module algo's function for collective."""
    return getattr(REGISTRY[algo], collective)


def check(algo: str, topo: Topology) -> None:
    """Raise ValueError if algo (a name from ALGORITHMS) cannot run on topo's world."""
    module = REGISTRY.get(algo)
    if module is not None and hasattr(module, "check"):
        module.check(Layout.of(topo))


def _group(algo: str, topo: Topology):
    return topo if getattr(REGISTRY[algo], "TAKES_TOPOLOGY", False) else topo.comm


def allreduce(algo: str, topo: Topology, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
              dtype: str) -> None:
    """Run algo's allreduce over topo's world."""
    function(algo, "allreduce")(_group(algo, topo), send, recv, op, dtype)


def reduce(algo: str, topo: Topology, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
           dtype: str) -> None:
    """recv = op over every rank's send (send may be recv), Average included: the data
    moves as a Sum and is divided once, by the ranks that contributed (average()'s rule).
    Where the algorithm folds the division into its reduction (FOLDS_AVERAGE), each rank
    divides the part it reduces, with no pass of its own; else a pass over the result. The
    bits are the same either way: each element is its Sum divided once."""
    if op is ReduceOp.Average and type(recv) is np.ndarray \
            and getattr(REGISTRY[algo], "FOLDS_AVERAGE", False):
        function(algo, "allreduce")(_group(algo, topo), send, recv, KERNEL_OP[op], dtype,
                                    divisor=max(contributors(topo.size), 1))
        return
    allreduce(algo, topo, send, recv, KERNEL_OP[op], dtype)
    average(recv, dtype, op, topo.size)


def average(out: np.ndarray, dtype: str, op: ReduceOp, n: int) -> None:
    """Finish an Average over n ranks that moved as a Sum, in place (floor division for
    integers); nothing for the other ops. It divides by the ranks that contributed
    (runtime/engine.contributors: n less the ranks inside join())."""
    if op is not ReduceOp.Average:
        return
    if isinstance(out, np.ndarray):
        ENGINE.native.divide_average(out, CODES[dtype], n)
    elif contributors(n) > 1:  # device memory (a CuPy array): the same rule
        kernels.divide(out, dtype, contributors(n))


def reducescatter(algo: str, topo: Topology, send: np.ndarray, recv: np.ndarray,
                  counts: list[int], op: ReduceOp, dtype: str) -> None:
    """Run algo's reducescatter over topo's world."""
    function(algo, "reducescatter")(_group(algo, topo), send, recv, counts, op, dtype)


def allgather(algo: str, topo: Topology, send: np.ndarray, recv: np.ndarray,
              counts: list[int]) -> None:
    """Run algo's allgather over topo's world."""
    function(algo, "allgather")(_group(algo, topo), send, recv, counts)


def alltoall(algo: str, topo: Topology, send: np.ndarray, recv: np.ndarray,
             send_counts: list[int], recv_counts: list[int]) -> None:
    """Run algo's alltoall over topo's world."""
    function(algo, "alltoall")(_group(algo, topo), send, recv, send_counts, recv_counts)


def broadcast(algo: str, topo: Topology, buf: np.ndarray, root: int) -> None:
    """Run algo's broadcast over topo's world."""
    function(algo, "broadcast")(_group(algo, topo), buf, root)
