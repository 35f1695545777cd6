"""The fault-tolerant agreement (runtime/faults.agree): every rank learns which ranks
passed ok=False, the same list everywhere (without ULFM, Open MPI's agreement is an
allreduce; the word's bits are the same)."""

from __future__ import annotations

import pytest

from collectives.runtime import faults, topology

pytestmark = pytest.mark.mpi


def test_agree_names_the_ranks_that_failed(comm):
    topo = topology.get()
    n = topo.size
    for failing in ([], [0], [n - 1], list(range(0, n, 2)), list(range(n))):
        assert faults.agree(topo, topo.rank not in failing) == sorted(set(failing))
