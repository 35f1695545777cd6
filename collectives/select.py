"""`auto`: choose the algorithm per call from an alpha-beta cost model.

Each algorithm's time is predicted from its step structure (see each module's docstring):
  steps x (alpha + o) + bytes on the wire x beta + bytes reduced x gamma
with separate (alpha, beta) for links inside a node and between nodes; o is our per-message
software overhead (zero for `mpi`, whose steps run in C). Every call also pays the agreement's
header exchange (log2 n steps in C), except a `tree` allreduce of at most PIGGYBACK_BYTES,
whose data rides in that exchange: so `auto` runs small allreduces as tree. The parameters come from a JSON
file written by `python -m collectives.calibrate` (path: COLLECTIVES_TUNING_FILE), or the
defaults below, measured on a 2-core Linux VM with Open MPI 5 shared memory.

The same file also holds each algorithm's measured time at a few sizes on the job's own
topology; where it matches the running job, `auto` interpolates those (piecewise alpha-beta:
t = alpha_k + beta_k m between measured sizes) instead of the formulas, because the MPI
library's internal algorithm choices and protocol switches are not in any formula."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import numpy as np

from . import topology
from .agreement import PIGGYBACK_BYTES
from .topology import Topology


@dataclasses.dataclass(frozen=True)
class Params:
    """Defaults: `python -m collectives.calibrate` at np=2 on the 2-core development VM
    (Open MPI 5 shared memory, 2026-11-22); the inter-node pair is a 1 Gbit/s link's."""

    alpha_intra: float = 1.6e-6   # s per message inside a node
    beta_intra: float = 2.2e-10   # s per byte inside a node (~4.6 GB/s, 64 MiB messages)
    alpha_inter: float = 30e-6    # s per message between nodes
    beta_inter: float = 8.0e-9    # s per byte between nodes (~1 Gbit/s)
    gamma: float = 1.66e-10       # s per byte reduced by our kernels (64 MiB, from memory)
    overhead: float = 1.2e-6      # s of Python per message in our algorithms
    mpi_call: float = 0.93e-6     # s of fixed cost per MPI library collective call


def _tuning() -> dict:
    return _load(topology.get().config.tuning_file)


@functools.cache
def _load(path: str | None) -> dict:
    if not path:
        return {}
    with open(path) as f:
        return json.load(f)


def params() -> Params:
    values = _tuning().get("params")
    return Params(**values) if values else Params()


def _measured(collective: str, nbytes: int, topo: Topology) -> dict[str, float] | None:
    """Interpolated measured seconds per algorithm, if the tuning file is for this topology."""
    tuning = _tuning()
    if tuning.get("nodes") != [len(n) for n in topo.nodes] or collective not in tuning.get(
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


def _link(topo: Topology, level: str) -> tuple[float, float]:
    p = params()
    if level == "intra" or len(topo.nodes) == 1:
        return p.alpha_intra, p.beta_intra
    return p.alpha_inter, p.beta_inter


def _log2(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0


def _doubling_steps(n: int) -> int:
    """Steps of recursive doubling over n ranks: log2 of the largest power of two, plus
    the fold in and out of the extra ranks (MPICH's scheme) when n is not a power of two."""
    pow2 = 1 << (n.bit_length() - 1)
    return _log2(pow2) + (0 if pow2 == n else 2)


def flat_cost(algo: str, collective: str, n: int, m: int, alpha: float, beta: float) -> float:
    """Predicted seconds for a flat algorithm over n ranks on links (alpha, beta)."""
    if n <= 1:
        return 0.0
    p = params()
    o = 0.0 if algo == "mpi" else p.overhead
    reduces = collective in ("allreduce", "reducescatter")
    ring_steps = {"allreduce": 2 * (n - 1), "reducescatter": n - 1, "allgather": n - 1,
                  "broadcast": n - 1}[collective]
    ring_bytes = {"allreduce": 2 * (n - 1) / n * m, "broadcast": m}.get(collective, (n - 1) / n * m)
    ring = ring_steps * (alpha + o) + ring_bytes * beta + (m * (n - 1) / n * p.gamma if reduces else 0)
    fold = 0 if n & (n - 1) == 0 else 2
    if collective == "allreduce":
        tree = _doubling_steps(n) * (alpha + o + m * beta + m * p.gamma)
    elif collective == "reducescatter":
        tree = _doubling_steps(n) * (alpha + o) + (m + fold * m) * beta + m * p.gamma
    elif collective == "allgather":
        tree = _log2(n) * (alpha + o) + (n - 1) / n * m * beta
    else:
        tree = _log2(n) * (alpha + o + m * beta)
    if algo == "ring":
        return ring
    if algo == "tree":
        return tree
    if algo == "shm":  # copy in, reduce a 1/n slice, copy out: ~2-3 passes over memory
        passes = {"allreduce": 3, "reducescatter": 2}.get(collective, 2)
        chunks = max(1, m // (1 << 20))
        return 3 * chunks * (alpha + o) + passes * m * p.gamma
    # the MPI library: its own best of similar algorithms, steps in C, one call's overhead
    o_saved = (ring_steps if ring < tree else _log2(n) + fold) * o
    return min(ring, tree) - o_saved + p.mpi_call


def choose_level(collective: str, level: str, nbytes: int, topo: Topology) -> str:
    """The cheapest flat algorithm for one level of a hierarchical call."""
    n = topo.local_size if level == "intra" else max(len(topo.nodes), 1)
    alpha, beta = _link(topo, level)
    options = ("ring", "tree", "mpi", "shm") if level == "intra" else ("ring", "tree", "mpi")
    return min(options, key=lambda a: flat_cost(a, collective, n, nbytes, alpha, beta))


def predict(algo: str, collective: str, nbytes: int, topo: Topology) -> float:
    """Predicted seconds for one call of algo on this topology."""
    if algo != "hierarchical":
        alpha, beta = _link(topo, "inter")
        return flat_cost(algo, collective, topo.size, nbytes, alpha, beta)
    L, N = topo.max_local_size, len(topo.nodes)
    ai, bi = _link(topo, "intra")
    ax, bx = _link(topo, "inter")
    best = min  # each level picks its own cheapest flat algorithm
    if collective == "allreduce":
        intra = (best(flat_cost(a, "reducescatter", L, nbytes, ai, bi) for a in ("ring", "tree", "mpi"))
                 + best(flat_cost(a, "allgather", L, nbytes, ai, bi) for a in ("ring", "tree", "mpi")))
        inter = best(flat_cost(a, "allreduce", N, nbytes // L, ax, bx) for a in ("ring", "tree", "mpi"))
        return intra + inter
    intra = best(flat_cost(a, collective, L, nbytes, ai, bi) for a in ("ring", "tree", "mpi"))
    inter = best(flat_cost(a, collective, N, nbytes, ax, bx) for a in ("ring", "tree", "mpi"))
    return 2 * intra + inter


def choose(collective: str, nbytes: int, topo: Topology) -> str:
    """The algorithm `auto` runs for this call (the same on every rank); memoized, as the
    model's inputs are fixed once the job is up."""
    key = (collective, nbytes, id(topo))
    algo = _choices.get(key)
    if algo is None:
        algo = _choices[key] = _choose(collective, nbytes, topo)
    return algo


_choices: dict[tuple, str] = {}


def _choose(collective: str, nbytes: int, topo: Topology) -> str:
    measured = _measured(collective, nbytes, topo)
    if measured:
        return min(measured, key=measured.get)
    costs = {a: predict(a, collective, nbytes, topo) + agreement_cost(topo)
             for a in candidates(topo)}
    if collective == "allreduce" and nbytes <= PIGGYBACK_BYTES:
        costs["tree"] = agreement_cost(topo, nbytes)
    return min(costs, key=costs.get)


def agreement_cost(topo: Topology, nbytes: int = 0) -> float:
    """The header exchange every call starts with (recursive doubling, steps in C),
    carrying and folding nbytes of a small tree allreduce (0: the header alone)."""
    alpha, beta = _link(topo, "inter")
    steps = _doubling_steps(topo.size)
    return steps * (alpha + nbytes * (beta + params().gamma)) + params().mpi_call


def candidates(topo: Topology) -> list[str]:
    """Algorithms `auto` may pick on this topology."""
    found = ["ring", "tree", "mpi"]
    if len(topo.nodes) == 1 and topo.size > 1:
        found.append("shm")
    if len(topo.nodes) > 1 and topo.max_local_size > 1:
        found.append("hierarchical")
    return found
