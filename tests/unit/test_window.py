"""When shared-memory waits poll and when they yield at once (runtime/window.py)."""

from __future__ import annotations

import pytest

from collectives.runtime import window


@pytest.mark.parametrize("told", ["", "0", "1", "true"])
def test_waits_yield_at_once_where_cores_are_oversubscribed(monkeypatch, told):
    """More ranks on the machine than cores, or a job that tells Open MPI to yield when
    idle (hosts emulated on one machine, each seeing only its own ranks): a waiting rank
    yields its core at once instead of polling first."""
    yields = told in ("1", "true")
    monkeypatch.setenv("OMPI_MCA_mpi_yield_when_idle", told)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(window.cores()))
    assert window.oversubscribed(1) == yields
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(window.cores() + 1))
    assert window.oversubscribed(1)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE")
    assert window.oversubscribed(window.cores()) == yields
    assert window.oversubscribed(window.cores() + 1)
