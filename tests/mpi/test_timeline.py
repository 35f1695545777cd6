"""The timeline: start/stop collective over the job, one Chrome-trace JSON written by rank
0 with a row per rank and each call's phases; COLLECTIVES_TIMELINE records from init to
shutdown; errors raised on every rank."""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import pytest

import collectives as C


@pytest.fixture
def folder(comm):
    """A folder rank 0 writes in (the same path on every rank)."""
    path = tempfile.mkdtemp() if comm.Get_rank() == 0 else None
    yield comm.bcast(path, root=0)


def _load(comm, path: str) -> list[dict] | None:
    comm.Barrier()
    if comm.Get_rank() != 0:
        return None
    with open(path) as f:
        return json.load(f)["traceEvents"]


def test_every_call_and_its_phases_on_every_ranks_row(comm, folder):
    r, n = comm.Get_rank(), comm.Get_size()
    path = os.path.join(folder, "trace.json")
    C.start_timeline(path, mark_cycles=True)
    C.allreduce(np.ones(1024, np.float32), name="loss")  # the fast entry, riding
    C.allreduce(np.ones(1024, np.float32), name="loss")
    handles = [C.allreduce_async(np.ones(1 << 16, np.float32), op=C.Sum) for _ in range(3)]
    for h in handles:
        C.synchronize(h)
    C.allgather(np.ones((r + 1, 2)))
    C.barrier()
    C.stop_timeline()
    C.allreduce(np.ones(4))  # not recorded
    events = _load(comm, path)
    if events is None:
        return
    assert {e["pid"] for e in events} == set(range(n))
    for rank in range(n):
        mine = [e for e in events if e["pid"] == rank]
        calls = [e for e in mine if e["ph"] == "X" and e["tid"] == 0
                 and e["name"] not in ("agreement", "transfer/reduce")]
        assert [e["name"] for e in calls] == ["loss", "loss", "allreduce", "allreduce",
                                             "allreduce", "allgather", "barrier"]
        loss = calls[0]
        assert loss["args"]["collective"] == "allreduce" and loss["args"]["name"] == "loss"
        assert loss["args"]["algorithm"] in C.ALGORITHMS[1:]  # the one that ran, not auto
        big = calls[2]
        assert big["args"]["bytes"] > 0 or n == 1
        for call in calls:  # phases inside their call
            inside = [e for e in mine if e["ph"] == "X" and e["tid"] == 0
                      and e["name"] in ("agreement", "transfer/reduce")
                      and call["ts"] <= e["ts"] <= call["ts"] + call["dur"] + 1e-3]
            assert inside and inside[0]["name"] == "agreement", call
        assert sum(1 for e in mine if e["name"] == "transfer/reduce") >= 4
        assert sum(1 for e in mine if e["name"] == "queued" and e["tid"] == 1) == 3
        assert sum(1 for e in mine if e["name"] == "done") == 7
        assert sum(1 for e in mine if e["name"] == "cycle") == 7
        assert all(e["ts"] >= 0 for e in mine if "ts" in e)


def test_errors_are_raised_on_every_rank_and_stop_without_start_is_a_no_op(comm, folder):
    C.stop_timeline()
    with pytest.raises(ValueError, match="file_path: .*rank 0 cannot write in"):
        C.start_timeline(os.path.join(folder, "missing", "trace.json"))
    with pytest.raises(TypeError, match="file_path: expected a str or path, got int"):
        C.start_timeline(3)
    with pytest.raises(TypeError, match="mark_cycles: expected a bool"):
        C.start_timeline(os.path.join(folder, "t.json"), mark_cycles="yes")
    C.start_timeline(os.path.join(folder, "t.json"))
    with pytest.raises(ValueError, match="already being recorded"):
        C.start_timeline(os.path.join(folder, "u.json"))
    C.stop_timeline()
    assert C.allreduce(np.ones(2), op=C.Sum).tolist() == [comm.Get_size()] * 2


def test_the_environment_variable_records_from_init_to_shutdown(comm, folder, monkeypatch):
    path = os.path.join(folder, "env.json")
    monkeypatch.setenv("COLLECTIVES_TIMELINE", path)
    C.shutdown()
    try:
        C.init()
        C.allreduce(np.ones(8), name="from env")
    finally:
        C.shutdown()
        monkeypatch.delenv("COLLECTIVES_TIMELINE")
        C.init()
    events = _load(comm, path)
    if events is not None:
        assert any(e["name"] == "from env" for e in events)
