"""The engine (collectives/runtime/engine.py, its state in C++ `_C.Engine`): calls run in
submission order on every rank; a sync call runs inline on its caller's thread when the
engine is free and queues behind earlier calls when it is not; done callbacks fire once,
on the engine's thread, and may submit more work; an error reaches only its own call's
handle; a Python thread keeps running while a call waits in its data phase (GIL released).

A gate (an async call whose move waits on an Event) holds the engine on every rank, so what
is submitted meanwhile is known to be queued: no test depends on timing. Every wait is
bounded by WAIT_S; a test that runs past it fails (and conftest aborts the job)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import WAIT_S, assert_equal, until

import collectives as C
from collectives import algorithms
from collectives.api import calls
from collectives.runtime import topology
from collectives.runtime.engine import ENGINE, Handle, Job

pytestmark = pytest.mark.mpi

#: The mpi4py tag of test_python_thread_runs_while_a_call_waits_in_its_data_phase's signal.
TAG_GO = 7301


def _wait(event: threading.Event, what: str) -> None:
    assert event.wait(WAIT_S), f"{what}: not within {WAIT_S}s"


def _result(handle: Handle) -> Any:
    """synchronize(handle), failing instead of hanging if the call never finishes."""
    until(lambda: C.poll(handle), handle.name)
    return C.synchronize(handle)


def _engine_free() -> bool:
    if not ENGINE.native.try_claim():
        return False
    ENGINE.native.release()
    return True


def _idle() -> None:
    """Wait until nothing is queued or running (a finished handle is done a moment before
    the engine lets go of its call)."""
    until(_engine_free, "engine idle")


def _custom(tag: str, move: Callable[[], Any]) -> tuple[Any, calls.Call, Job]:
    """A call of our own (the same on every rank) whose data phase is move()."""
    topo = topology.get()
    return topo, calls.describe(topo, "engine_test", (("tag", tag),), "test"), Job(move)


def submit(tag: str, move: Callable[[], Any]) -> Handle:
    return ENGINE.submit(*_custom(tag, move))


def run(tag: str, move: Callable[[], Any]) -> Any:
    return ENGINE.run(*_custom(tag, move))


class Gate:
    """An async call holding the engine until open(): calls submitted meanwhile queue."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.entered = threading.Event()
        self.thread: threading.Thread | None = None  # the engine's thread, which ran it
        self.handle = submit("gate", self._hold)

    def _hold(self) -> None:
        self.thread = threading.current_thread()
        self.entered.set()
        _wait(self._open, "gate opened")

    def release(self) -> None:
        """Let the gate's move return (without waiting for it)."""
        self._open.set()

    def open(self) -> None:
        self.release()
        _result(self.handle)


def _ramp(rank: int, i: int) -> np.ndarray:
    return np.arange(7, dtype=np.float64) * (rank + 1) + i


def _ramp_sum(n: int, i: int) -> np.ndarray:
    return np.arange(7, dtype=np.float64) * (n * (n + 1) // 2) + n * i


# ------------------------------------------------------------------------------ ordering

def test_async_calls_run_and_complete_in_submission_order(comm):
    """Allreduces (three algorithms) and broadcasts (every root) queued behind a gate: each
    result is right and the done callbacks fire in submission order on every rank."""
    n, rank = comm.Get_size(), comm.Get_rank()
    finished: list[int] = []
    gate = Gate()
    handles, expected = [], []
    for i in range(24):
        if i % 4 == 3:
            root = i % n
            x = np.full(5, float(i) if rank == root else -1.0)
            handles.append(C.broadcast_async(x, root_rank=root))
            expected.append(np.full(5, float(i)))
        else:
            algo = ("ring", "tree", "mpi")[i % 4]
            handles.append(C.allreduce_async(_ramp(rank, i), op=C.Sum, algorithm=algo))
            expected.append(_ramp_sum(n, i))
        handles[-1].add_done_callback(lambda h, i=i: finished.append(i))
    assert not any(C.poll(h) for h in handles), "ran while the gate held the engine"
    gate.open()
    for i, (h, want) in enumerate(zip(handles, expected)):
        assert_equal(_result(h), want, f"call {i}")
    until(lambda: len(finished) == len(handles), "done callbacks")
    assert finished == list(range(len(handles)))
    assert comm.allgather(finished) == [finished] * n


def test_sync_call_queues_behind_queued_async_calls(comm, monkeypatch):
    """A sync allreduce made while async calls wait behind a gate goes through the queue
    (the gate opens only once it is there) and reads the data they wrote."""
    n = comm.Get_size()
    gate = Gate()
    x = np.ones(6)
    first = C.allreduce_async_(x, op=C.Sum, algorithm="ring", postscale_factor=3.0)
    second = C.allreduce_async(np.full(4, 2.0), op=C.Sum, algorithm="tree")
    queued: list[Handle] = []
    real_submit = ENGINE.submit

    def submit_and_open(*args: Any) -> Handle:
        queued.append(real_submit(*args))
        gate.release()  # the sync call is in the queue now
        return queued[-1]

    monkeypatch.setattr(ENGINE, "submit", submit_and_open)
    y = C.allreduce(x, op=C.Sum, algorithm="ring")
    monkeypatch.undo()
    assert len(queued) == 1 and queued[0].name == "allreduce", queued
    assert C.poll(first) and C.poll(second), "the sync call finished before earlier calls"
    assert_equal(y, np.full(6, 3.0 * n * n), "sync result (x after the in-place async)")
    assert_equal(_result(first), np.full(6, 3.0 * n), "first async")
    assert_equal(_result(second), np.full(4, 2.0 * n), "second async")
    _result(gate.handle)


# ----------------------------------------------------------------------------- the claim

def test_sync_call_runs_inline_on_the_callers_thread_when_the_engine_is_free(comm):
    _idle()
    ran_on = run("inline main", threading.current_thread)
    assert ran_on is threading.current_thread()
    # from another thread of the caller's too (not merely "the main thread")
    box: list[Any] = []
    caller = threading.Thread(target=lambda: box.append(
        (threading.current_thread(), run("inline thread", threading.current_thread))))
    caller.start()
    caller.join(WAIT_S)
    assert not caller.is_alive(), "the sync call from a second thread hung"
    assert box and box[0][1] is box[0][0], box


def test_try_claim_fails_while_a_call_runs_or_is_queued(comm):
    _idle()
    assert ENGINE.native.try_claim()
    try:
        assert not ENGINE.native.try_claim(), "claimed twice"
    finally:
        ENGINE.native.release()
    gate = Gate()
    _wait(gate.entered, "gate running")
    assert not ENGINE.native.try_claim(), "claimed while the gate runs"
    behind = C.allreduce_async(np.ones(2), op=C.Sum, algorithm="ring")
    assert not ENGINE.native.try_claim(), "claimed while a call runs and one is queued"
    gate.open()
    assert_equal(_result(behind), np.full(2, float(comm.Get_size())), "queued call")
    _idle()  # and free again once both are done


# ----------------------------------------------------------------------------- callbacks

def test_done_callbacks_fire_once_on_the_engine_thread_after_the_call(comm):
    n = comm.Get_size()
    seen: list[tuple] = []
    order: list[str] = []
    both = threading.Event()

    def first(h: Handle) -> None:
        # nothing is queued behind h: the engine has let go of it, so the claim is free
        seen.append((threading.current_thread(), h.done(), C.synchronize(h), _engine_free()))
        order.append("first")

    def second(h: Handle) -> None:
        order.append("second")
        both.set()

    gate = Gate()
    h = C.allreduce_async(np.arange(4.0), op=C.Sum, algorithm="ring")
    h.add_done_callback(first)
    h.add_done_callback(second)
    assert seen == [] and order == [], "fired before the call ran"
    gate.open()
    _wait(both, "callbacks")
    (thread, done, result, free), = seen
    assert thread is gate.thread and thread is not threading.current_thread()
    assert done and free
    assert_equal(result, np.arange(4.0) * n, "result seen by the callback")
    assert order == ["first", "second"]
    C.allreduce(np.ones(2), op=C.Sum)  # later calls do not fire h's callbacks again
    _idle()
    assert len(seen) == 1 and order == ["first", "second"]


def test_callback_added_after_completion_fires_at_once_on_the_callers_thread(comm):
    fired = threading.Event()
    h = C.allreduce_async(np.ones(3), op=C.Sum, algorithm="ring")
    h.add_done_callback(lambda h: fired.set())
    _result(h)
    _wait(fired, "first callback")  # h's callbacks have fired: a new one runs at once
    late: list[threading.Thread] = []
    h.add_done_callback(lambda h: late.append(threading.current_thread()))
    assert late == [threading.current_thread()]


def test_raising_callback_does_not_stop_the_engine(comm, capsys):
    n, rank = comm.Get_size(), comm.Get_rank()
    after: list[Handle] = []

    def boom(h: Handle) -> None:
        raise RuntimeError("boom from a done callback")

    gate = Gate()
    h1 = C.allreduce_async(np.ones(3), op=C.Sum, algorithm="ring")
    h1.add_done_callback(boom)
    h1.add_done_callback(after.append)  # the next callback of the same handle still fires
    x = np.full(3, 5.0) if rank == n - 1 else np.zeros(3)
    h2 = C.broadcast_async(x, root_rank=n - 1)
    gate.open()
    assert_equal(_result(h2), np.full(3, 5.0), "call after the raising callback")
    assert_equal(_result(h1), np.full(3, float(n)), "call with the raising callback")
    assert after == [h1]
    assert_equal(C.allreduce(np.ones(2), op=C.Sum), np.full(2, float(n)), "sync after")
    assert "boom from a done callback" in capsys.readouterr().err  # still shown


def test_callback_may_submit_an_async_call(comm):
    n = comm.Get_size()
    inner: list[tuple] = []
    submitted = threading.Event()

    def submit_more(h: Handle) -> None:
        inner.append((threading.current_thread(),
                      C.allreduce_async(np.full(3, 2.0), op=C.Sum, algorithm="tree")))
        submitted.set()

    gate = Gate()
    h = C.allreduce_async(np.ones(3), op=C.Sum, algorithm="ring")
    h.add_done_callback(submit_more)
    gate.open()
    _wait(submitted, "callback")  # nothing else is submitted meanwhile: ranks stay in step
    (thread, more), = inner
    assert thread is gate.thread
    assert_equal(_result(more), np.full(3, 2.0 * n), "call submitted by the callback")
    assert_equal(_result(h), np.full(3, float(n)), "outer call")


def test_sync_call_from_a_callback_raises_while_calls_are_queued(comm):
    n = comm.Get_size()
    outcome: list[Any] = []
    tried = threading.Event()

    def sync_call(h: Handle) -> None:
        try:
            outcome.append(C.allreduce(np.ones(2), op=C.Sum, algorithm="ring"))
        except RuntimeError as exc:
            outcome.append(exc)
        tried.set()

    gate = Gate()
    h1 = C.allreduce_async(np.ones(3), op=C.Sum, algorithm="ring")
    h1.add_done_callback(sync_call)
    h2 = C.allreduce_async(np.full(3, 4.0), op=C.Sum, algorithm="ring")  # queued behind h1
    gate.open()
    _wait(tried, "callback")
    (error,) = outcome
    assert isinstance(error, RuntimeError), error
    assert "completion callback" in str(error) and "allreduce" in str(error), error
    assert_equal(_result(h1), np.full(3, float(n)), "h1")
    assert_equal(_result(h2), np.full(3, 4.0 * n), "h2: still runs")


def test_sync_call_from_a_callback_runs_when_nothing_is_queued(comm):
    n = comm.Get_size()
    outcome: list[Any] = []
    tried = threading.Event()

    def sync_call(h: Handle) -> None:
        outcome.append(C.allreduce(np.ones(2), op=C.Sum, algorithm="ring"))
        tried.set()

    gate = Gate()
    h = C.allreduce_async(np.ones(3), op=C.Sum, algorithm="ring")
    h.add_done_callback(sync_call)
    gate.open()
    _wait(tried, "callback")  # nothing is submitted meanwhile
    assert_equal(outcome[0], np.full(2, float(n)), "sync call inside the callback")
    assert_equal(_result(h), np.full(3, float(n)), "h")


# -------------------------------------------------------------------------------- errors

def test_error_in_a_queued_call_reaches_only_its_handle(comm):
    n, rank = comm.Get_size(), comm.Get_rank()

    def fail() -> None:
        raise ValueError("move failed on purpose")

    gate = Gate()
    before = C.allreduce_async(np.ones(3), op=C.Sum, algorithm="ring")
    failing = submit("fails", fail)
    after = C.allreduce_async(_ramp(rank, 1), op=C.Sum, algorithm="tree")
    root = C.broadcast_async(np.full(2, 9.0 if rank == 0 else 0.0), root_rank=0)
    gate.open()
    assert_equal(_result(before), np.full(3, float(n)), "call before the failing one")
    assert_equal(_result(after), _ramp_sum(n, 1), "call after the failing one")
    assert_equal(_result(root), np.full(2, 9.0), "broadcast after the failing one")
    for _ in range(2):  # every synchronize() of the failed call raises its error
        with pytest.raises(ValueError, match="move failed on purpose"):
            _result(failing)
    assert_equal(C.allreduce(np.ones(2), op=C.Sum), np.full(2, float(n)), "sync after")


@pytest.mark.mpi(min_size=2)
def test_mismatch_in_a_queued_call_reaches_only_its_handle(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    bad = C.allreduce_async(np.ones(4 if rank == 0 else 5), op=C.Sum, algorithm="ring")
    good = C.allreduce_async(np.ones(3), op=C.Sum, algorithm="ring")
    with pytest.raises(C.MismatchError, match="shape"):
        _result(bad)
    assert_equal(_result(good), np.full(3, float(n)), "call after the mismatch")


# ------------------------------------------------------------------------------- the GIL

@pytest.mark.mpi(min_size=2)
def test_python_thread_runs_while_a_call_waits_in_its_data_phase(comm, monkeypatch):
    """Rank 1 starts its data phase only on rank 0's signal, which rank 0's main thread
    sends once its engine is inside the call (past the agreement, data moving): if waiting
    for data held the GIL, rank 0 could not send it and rank 1 would give up."""
    n, rank = comm.Get_size(), comm.Get_rank()
    _idle()
    if rank == 1:
        real_reduce = algorithms.reduce

        def reduce_on_signal(*args: Any) -> None:
            until(lambda: comm.Iprobe(source=0, tag=TAG_GO), "rank 0's signal")
            comm.recv(source=0, tag=TAG_GO)
            real_reduce(*args)

        monkeypatch.setattr(algorithms, "reduce", reduce_on_signal)
    h = C.allreduce_async(_ramp(rank, 0), op=C.Sum, algorithm="ring")
    if rank == 0:
        until(lambda: ENGINE.native.snapshot()[:1] == ("running",), "engine in the call")
        assert ENGINE.native.snapshot()[2] == "allreduce"
        assert not C.poll(h), "finished without rank 1's data"
        comm.send(None, dest=1, tag=TAG_GO)
    assert_equal(_result(h), _ramp_sum(n, 0), "allreduce")
