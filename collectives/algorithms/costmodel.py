"""The inputs of every algorithm's cost(): the machine's speeds (Params) and the shape of
the group a call runs over (Layout).

An algorithm's time is predicted from its step structure (see each module's docstring in
collectives/algorithms/):
  steps x (alpha + o) + bytes on the wire x beta + bytes reduced x gamma
with separate (alpha, beta) for links inside a node and between nodes; o is our per-message
software overhead (zero for `mpi`, whose steps run in C and which pays one mpi_call instead).
The parameters come from the tuning in force (collectives/auto/autotune.py: the file written
by `python -m collectives calibrate`, or the job's own measurement), or the defaults below."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Params:
    """Defaults: `python -m collectives calibrate` at np=2 on a two-core host (Open MPI 5,
    shared memory between the ranks); the inter-node pair is a 1 Gbit/s link's."""

    alpha_intra: float = 1.6e-6   # s per message inside a node
    beta_intra: float = 2.2e-10   # s per byte inside a node (~4.6 GB/s, 64 MiB messages)
    alpha_inter: float = 30e-6    # s per message between nodes
    beta_inter: float = 8.0e-9    # s per byte between nodes (~1 Gbit/s)
    gamma: float = 1.66e-10       # s per byte reduced by our kernels (64 MiB, from memory)
    overhead: float = 1.2e-6      # s of Python per message in our algorithms
    mpi_call: float = 0.93e-6     # s of fixed cost per MPI library collective call


@dataclasses.dataclass(frozen=True)
class Layout:
    """The ranks of a group, as the number of ranks on each of its nodes (in node order)."""

    node_sizes: tuple[int, ...]

    @classmethod
    def of(cls, topo) -> Layout:
        """The layout of a Topology's world communicator."""
        return cls(tuple(len(node) for node in topo.nodes))

    @property
    def size(self) -> int:
        return sum(self.node_sizes)

    @property
    def nodes(self) -> int:
        return len(self.node_sizes)

    @property
    def max_local(self) -> int:
        return max(self.node_sizes, default=0)

    def intra(self) -> Layout:
        """One node's group, sized as the largest node (hierarchical's node level)."""
        return Layout((self.max_local,))

    def inter(self) -> Layout:
        """One rank per node (hierarchical's cross-node level)."""
        return Layout((1,) * self.nodes)

    def link(self, p: Params) -> tuple[float, float]:
        """(alpha, beta) of the slowest link the group uses: inside a node if it has one."""
        if self.nodes <= 1:
            return p.alpha_intra, p.beta_intra
        return p.alpha_inter, p.beta_inter

    def message(self, p: Params) -> tuple[float, float]:
        """(seconds per message, seconds per byte) of an algorithm step driven from Python:
        the link's latency plus our per-message overhead, and its inverse bandwidth."""
        alpha, beta = self.link(p)
        return alpha + p.overhead, beta


def log2_steps(n: int) -> int:
    """ceil(log2 n) for n > 1, else 0: the steps of a binomial tree or of Bruck's algorithm."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0


_installed: dict = {}


def tuning() -> dict:
    """The tuning `auto` uses: what init installed (autotune.setup: the tuning file, the
    cache, or a fresh measurement), {} before init or when there is none."""
    return _installed


def install(tuning: dict) -> None:
    """Make tuning the one in force; callers go through select.install_tuning, which also
    drops the choices made under the old one."""
    global _installed
    _installed = tuning


def general_path_s() -> float:
    """The measured extra seconds of a call on the general path over its fast entry
    (autotune.general_path), 0 where none was measured."""
    value = tuning().get("general_path_s", 0.0)
    return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0


def params() -> Params:
    """The tuning file's parameters, else the defaults."""
    values = tuning().get("params")
    return Params(**values) if values else Params()
