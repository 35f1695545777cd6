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


def cheapest(collective: str, nbytes: int, layout: Layout, p: Params) -> str:
    """The flat algorithm with the lowest cost for this call on layout."""
    found = {name: m.cost(collective, nbytes, layout, p) for name, m in FLAT.items()}
    found = {name: t for name, t in found.items() if t < math.inf}
    return min(found, key=found.get)
