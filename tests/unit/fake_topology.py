"""A stand-in for collectives.runtime.topology.Topology in tests that need no MPI job."""

from __future__ import annotations


class FakeTopology:
    """What select and the algorithm registry read from a Topology: its nodes (world ranks
    per node, nodes in order) and sizes, seen from world rank 0, and the upper layers'
    state objects (state(): `auto`'s, with no class settled online)."""

    def __init__(self, *node_sizes: int):
        first = [sum(node_sizes[:i]) for i in range(len(node_sizes))]
        self.nodes = [list(range(f, f + s)) for f, s in zip(first, node_sizes)]
        self.size = sum(node_sizes)
        self.local_size = node_sizes[0]
        self.max_local_size = max(node_sizes)
        self._states: dict[type, object] = {}

    def state(self, kind: type) -> object:
        """Topology.state: kind's object for this topology, made on first use."""
        if kind not in self._states:
            self._states[kind] = kind()
        return self._states[kind]
