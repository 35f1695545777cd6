"""`auto`: choose the algorithm per call as the minimum over the registered algorithms' costs.

Each module in collectives/algorithms/ prices a call with its cost() (the alpha-beta model
of collectives/algorithms/costmodel.py, over the job's Layout). Every call also pays the
agreement's header exchange (agreement_cost), except a small allreduce whose data rides in
that exchange (collectives/api/calls.py: riding()): `shm` up to SHARED_BYTES on one node,
where the exchange is one step in shared memory, `tree` up to PIGGYBACK_BYTES across
nodes, where it is recursive doubling; so `auto` runs small allreduces that way.

The tuning file also holds each algorithm's measured time at a few sizes on the job's own
topology; where it matches the running job, `auto` interpolates those (piecewise alpha-beta:
t = alpha_k + beta_k m between measured sizes) instead of the formulas, because the MPI
library's internal algorithm choices and protocol switches are not in any formula."""

from __future__ import annotations

import numpy as np

from collectives import algorithms
from collectives.algorithms import costmodel, tree
from collectives.algorithms.costmodel import Layout
from collectives.auto import state
from collectives.runtime.agreement import PIGGYBACK_BYTES, SHARED_BYTES
from collectives.runtime.topology import Topology


def _measured(collective: str, nbytes: int, topo: Topology) -> dict[str, float] | None:
    """Interpolated measured seconds per algorithm, if the tuning file is for this topology."""
    tuning = costmodel.tuning()
    if tuning.get("nodes") != list(Layout.of(topo).node_sizes) or collective not in tuning.get(
            "measured", {}):
        return None
    table = tuning["measured"][collective]  # {algo: [[bytes, seconds], ...]}
    out = {}
    for algo, points in table.items():
        sizes, times = zip(*points)
        if nbytes <= sizes[0]:
            out[algo] = times[0]
        elif nbytes >= sizes[-1]:  # extrapolate the last segment's bandwidth
            slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
            out[algo] = times[-1] + slope * (nbytes - sizes[-1])
        else:
            out[algo] = float(np.interp(nbytes, sizes, times))
    return out


def concrete(topo: Topology, collective: str, algorithm: str, nbytes: int,
             inplace: bool = False) -> str:
    """The algorithm a call runs: `auto`'s choice, or the named one if it can run here
    (inplace: an allreduce whose result overwrites its input)."""
    if algorithm == "auto":
        return choose(collective, nbytes, topo, inplace)
    algorithms.check(algorithm, topo)
    return algorithm


def choose(collective: str, nbytes: int, topo: Topology, inplace: bool = False) -> str:
    """The algorithm `auto` runs for this call (the same on every rank: it depends only on
    agreed values and on what every rank settled alike): an allreduce's class settled
    online (by its size and whether it is in place), for its sizes too large to ride in the
    agreement (online.py; read afresh, as it settles on the engine's thread while callers
    describe calls), else the fastest estimate, memoized per communicator until the
    estimates' inputs change (estimates_changed())."""
    auto = state.of(topo)
    settled = auto.settled.get(size_class(nbytes, inplace)) \
        if collective == "allreduce" and auto.settled and nbytes > topo.channel.capacity \
        else None
    return settled or _fastest(auto, collective, nbytes, topo)


#: Choices memoized per communicator; past this the memo starts over.
MEMO_SIZE = 4096
_version = 0  # of the estimates' inputs: estimates_changed() counts it up


def install_tuning(tuning: dict) -> None:
    """Put tuning in force (costmodel.install) and let every communicator's memo of
    choices go stale with it: the one way to change the tuning."""
    costmodel.install(tuning)
    estimates_changed()


def estimates_changed() -> None:
    """The estimates' inputs changed (the tuning in force, costmodel.install): every
    communicator's memo of choices is stale."""
    global _version
    _version += 1


def _fastest(auto: state.AutoState, collective: str, nbytes: int, topo: Topology) -> str:
    if auto.version != _version or len(auto.memo) >= MEMO_SIZE:
        auto.memo.clear()
        auto.version = _version
    found = auto.memo.get((collective, nbytes))
    if found is None:
        times = estimates(collective, nbytes, topo)
        found = auto.memo[(collective, nbytes)] = min(times, key=times.get)
    return found


def estimates(collective: str, nbytes: int, topo: Topology) -> dict[str, float]:
    """Seconds per algorithm for this call: measured where the tuning is for this
    topology, else the model's."""
    return _measured(collective, nbytes, topo) or predict(collective, nbytes, Layout.of(topo),
                                                          costmodel.params())


def size_class(nbytes: int, inplace: bool = False) -> int:
    """What online.py settles an allreduce's algorithm for: sizes within a factor of 4,
    [4^(k-1), 4^k) bytes, and whether the call is in place: class 2k + inplace. The
    fastest can differ between the two: the MPI library's allreduce out of place can cost
    much more than in place while ours hardly differ, so one settled choice would be wrong
    for one of them (benchmarks/README.md, A first job and the next one)."""
    return 2 * ((max(nbytes, 1).bit_length() + 1) // 2) + inplace


def predict(collective: str, nbytes: int, layout: Layout, p: costmodel.Params
            ) -> dict[str, float]:
    """The model's seconds for each algorithm that can run a call of nbytes on layout,
    the agreement's exchange included (what `auto` minimizes without measured times)."""
    agreement = agreement_cost(layout, p)
    costs = {a: t + agreement for a, t in algorithms.costs(collective, nbytes, layout,
                                                            p).items()}
    if collective == "allreduce":
        rider = "shm" if _shared(layout) else "tree"
        if nbytes <= (SHARED_BYTES if _shared(layout) else PIGGYBACK_BYTES):
            costs[rider] = agreement_cost(layout, p, nbytes)
    return costs


def _shared(layout: Layout) -> bool:
    """Whether the layout's agreement runs in shared memory (one node, several ranks)."""
    return layout.nodes == 1 and layout.size > 1


def agreement_cost(layout: Layout, p: costmodel.Params, nbytes: int = 0) -> float:
    """The header exchange every call starts with, carrying and folding nbytes of a small
    allreduce (0: the header alone). On one node: one step in shared memory, a counter
    wait (priced as a message inside the node) after copying nbytes in, then every rank
    folds all L copies. Across nodes: recursive doubling, steps in C."""
    if _shared(layout):
        return p.alpha_intra + nbytes * (1 + layout.size) * p.gamma
    alpha, beta = layout.link(p)
    steps = tree.doubling_steps(layout.size)
    return steps * (alpha + nbytes * (beta + p.gamma)) + p.mpi_call


def candidates(topo: Topology) -> list[str]:
    """Algorithms `auto` may pick on this topology (those with a finite cost)."""
    return list(algorithms.costs("allreduce", 0, Layout.of(topo), costmodel.params()))
