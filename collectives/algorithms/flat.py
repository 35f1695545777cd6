"""The flat algorithms (one level: every rank of a communicator takes part alike) and the
cheapest of them for a call: what hierarchical runs at each of its levels, and the part of
the registry it may use without depending on itself."""

from __future__ import annotations

import math
from types import ModuleType

from collectives.algorithms import mpi, ring, shm, tree
from collectives.algorithms.costmodel import Layout, Params

#: Every flat algorithm by name; a tie in cost goes to the earlier one.
FLAT: dict[str, ModuleType] = {"ring": ring, "tree": tree, "shm": shm, "mpi": mpi}


def ours() -> tuple[str, ...]:
    """The flat algorithms of our own (every one but `mpi`): hierarchical's node level runs
    one of these. MPI's own one-node collectives are left out there because mpi.cost
    prices them at ring's bandwidth terms, which Open MPI's one-node reduce_scatter is
    far from (benchmarks/README.md, "Two-level allreduce against the link")."""
    return tuple(name for name in FLAT if name != "mpi")


def cheapest(collective: str, nbytes: int, layout: Layout, p: Params,
             among: tuple[str, ...] = tuple(FLAT)) -> str:
    """The algorithm of `among` (by default every flat one) with the lowest cost for this
    call on layout."""
    found = {name: FLAT[name].cost(collective, nbytes, layout, p) for name in among}
    found = {name: t for name, t in found.items() if t < math.inf}
    return min(found, key=found.get)
