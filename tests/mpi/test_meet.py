"""collectives/runtime/meet.py: ranks meeting beside the engine agree on the least of one
integer each and every rank returns it, however the values and arrival times fall and
however many meetings follow one another; a meeting is not held up by a call this rank has
queued on the engine, even one the other ranks start only after the meeting; and it is
available exactly under MPI_THREAD_MULTIPLE. Every meeting runs on a helper thread joined
with a timeout, so a meeting that never ends fails the test instead of hanging it."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from conftest import WAIT_S, assert_equal, until
from mpi4py import MPI

import collectives as C
from collectives.runtime import meet, topology

pytestmark = pytest.mark.mpi

INT64 = np.iinfo(np.int64)

needs_threads = pytest.mark.skipif(
    MPI.Query_thread() != MPI.THREAD_MULTIPLE,
    reason="ranks meet beside the engine only under MPI_THREAD_MULTIPLE")


def _meet(value: int) -> int:
    """meet.meet(job, value), failing the test if it is not back within WAIT_S."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = meet.meet(topology.get(), value)
        except BaseException as exc:  # shown to the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive(), f"meet({value}) not back within {WAIT_S}s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_available_exactly_under_thread_multiple():
    assert meet.available() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    assert isinstance(meet.available(), bool)


@needs_threads
@pytest.mark.parametrize("pattern", ["rank", "reversed", "middle", "equal", "extremes",
                                     "negative", "late"])
def test_every_rank_gets_the_least_value(comm, pattern):
    n, r = comm.Get_size(), comm.Get_rank()
    value = {"rank": 10 + r,
             "reversed": 10 + n - 1 - r,
             "middle": -5 if r == n // 2 else 1000 + r,
             "equal": 42,
             "extremes": INT64.min if r == n - 1 else INT64.max - r,
             "negative": -(r + 1) * 3,
             "late": 100 - r}[pattern]
    if pattern == "late":  # the least value comes from the last rank to arrive
        time.sleep(0.05 * r)
    got = _meet(value)
    assert got == min(comm.allgather(value)), (pattern, value, got)
    assert isinstance(got, int)


@needs_threads
def test_meetings_in_a_row_keep_apart(comm):
    """Each of many back-to-back meetings (ranks drifting apart in between) gets its own
    least value: no message of one meeting satisfies another."""
    n, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(r)
    for i in range(30):
        value = 1000 * i + (r + i) % n
        if rng.random() < 0.3:
            time.sleep(0.002)
        assert _meet(value) == 1000 * i, f"meeting {i}"


@needs_threads
def test_a_meeting_is_not_held_up_by_a_call_queued_on_the_engine(comm):
    """Rank 0 starts an async allreduce, then meets; the others meet first and start the
    allreduce only after: rank 0's engine waits in that call's agreement all the while,
    and the meeting must still end (then the call finishes with the right result)."""
    n, r = comm.Get_size(), comm.Get_rank()
    x = np.arange(9.0) + r
    handle = C.allreduce_async(x, op=C.Sum) if r == 0 else None
    assert _meet(r + 7) == 7
    if r != 0:
        handle = C.allreduce_async(x, op=C.Sum)
    until(lambda: C.poll(handle), "the allreduce done")
    assert_equal(C.synchronize(handle), np.arange(9.0) * n + n * (n - 1) / 2, "the allreduce")
    assert _meet(r) == 0


def test_without_thread_multiple_meet_refuses(monkeypatch):
    monkeypatch.setattr(meet, "available", lambda: False)
    with pytest.raises(RuntimeError, match="MPI_THREAD_MULTIPLE"):
        meet.meet(topology.get(), 1)
