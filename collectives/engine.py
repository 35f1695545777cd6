"""Executes collectives in submission order, on a background progress thread for async
calls and inline on the caller's thread for sync calls when nothing is queued.

Every rank submits collectives in the same program order, and this engine runs them in
that order, so async work never reorders MPI calls across ranks. At most one collective runs
at a time (MPI_THREAD_SERIALIZED is enough for our own calls; mpi4py asks for MULTIPLE so
user threads may use MPI too). Data moves and reduces with the GIL released (mpi4py's
blocking calls and our kernels release it), so Python work overlaps communication."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any


class Handle:
    """An in-flight collective: pass it to synchronize() for the result, poll() to ask."""

    __slots__ = ("name", "_done", "_result", "_error")

    def __init__(self, name: str):
        self.name = name
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self._result = work()
        except BaseException as exc:  # delivered to whoever synchronizes
            self._error = exc
        finally:
            self._done.set()


class Engine:
    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())  # guards the queue
        self._queue: collections.deque[tuple[Handle, Callable[[], Any]]] = collections.deque()
        self._running = threading.Lock()  # held while a collective executes
        self._thread: threading.Thread | None = None

    def submit(self, name: str, work: Callable[[], Any]) -> Handle:
        """Queue work behind everything submitted before; returns at once."""
        handle = Handle(name)
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="collectives-engine",
                                                daemon=True)
                self._thread.start()
            self._queue.append((handle, work))
            self._cv.notify()
        return handle

    def run(self, name: str, work: Callable[[], Any]) -> Any:
        """Run work after everything submitted before and return its result."""
        if not self.enter_inline():
            return self.submit(name, work).wait()
        try:
            return work()
        finally:
            self.leave_inline()

    def enter_inline(self) -> bool:
        """Claim the engine for a sync call on the caller's thread; False if work is queued
        or running (then the call must be submitted). Pair with leave_inline()."""
        if self._queue or not self._running.acquire(False):
            return False
        if self._queue:  # queued meanwhile: it goes first
            self._running.release()
            return False
        return True

    def leave_inline(self) -> None:
        self._running.release()

    def inline_claim(self) -> tuple[collections.deque, Any]:
        """(queue, running lock): what a C++ fast entry needs to claim the engine exactly as
        enter_inline() and leave_inline() do (csrc/cpu/bind_agreement.cpp)."""
        return self._queue, self._running

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
            with self._running:  # popped only while held: a sync call never overtakes it
                with self._cv:
                    handle, work = self._queue.popleft()
                handle._run(work)


ENGINE = Engine()
