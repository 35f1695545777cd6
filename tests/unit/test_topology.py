"""topology.init's own checks, in one process."""

import pytest
from mpi4py import MPI

from collectives.runtime import topology


@pytest.mark.parametrize("level", [MPI.THREAD_SINGLE, MPI.THREAD_FUNNELED])
def test_init_refuses_a_thread_level_below_serialized(monkeypatch, level):
    monkeypatch.setattr(topology, "_topology", None)
    monkeypatch.setattr(MPI, "Query_thread", lambda: level)
    with pytest.raises(RuntimeError, match="MPI_THREAD_SERIALIZED"):
        topology.init()
    assert topology._topology is None


def test_init_rejects_a_non_communicator(monkeypatch):
    monkeypatch.setattr(topology, "_topology", None)
    with pytest.raises(TypeError, match="comm: expected an mpi4py MPI.Comm, got int"):
        topology.init(comm=0)
