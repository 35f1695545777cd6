"""Executes collectives in submission order: on a background thread for async calls, inline
on the caller's thread for sync calls when nothing is queued or running.

Every rank submits collectives in the same program order, and this engine runs them in
that order, so async work never reorders MPI calls across ranks. At most one collective runs
at a time (MPI_THREAD_SERIALIZED is enough for our own calls; mpi4py asks for MULTIPLE so
user threads may use MPI too). Data moves and reduces with the GIL released, so Python work
overlaps communication.

The engine's state lives in C++ (`_C.Engine`, csrc/runtime/engine.h) and nowhere else: the
queue, the claim, the stall record, the failed flag and the byte counts. One call runs as
`_C.Engine.execute`: stall record, agreement exchange over the call's communicator (with a
payload riding in it), then the job's `move` (the algorithm), then the call's stats. The
allreduce fast entry (`_C.FastAllreduce`) is that same execute behind a claim, its move in C++
when it has one (shm's pipeline on one node)."""

from __future__ import annotations

import atexit
import functools
import threading
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np

from collectives.dtypes import CODES
from collectives.kernels import _C
from collectives.runtime import faults, profiling


class Communicator(Protocol):
    """What the engine reads of a communicator (runtime/topology.py's Topology)."""

    channel: Any  # _C.AgreeChannel: its agreement exchange
    stats: Any  # _C.Stats: its label names it in the profiler's ranges

    def state(self, kind: type) -> Any: ...  # runtime/faults.py's Failures among them


class Described(Protocol):
    """What the engine reads of a described call (api/calls.py's Call)."""

    collective: str
    fields: tuple  # ((name, value), ...): what the profiler's ranges show of it
    algorithm: str
    native: Any  # _C.Call: digest, stall-record text, counter, mismatch report


_NO_DATA = np.empty(0, np.uint8)
_UINT8 = CODES["uint8"]
_CALLBACKS = threading.Lock()  # guards every Handle's callback list


class Job(NamedTuple):
    """What one call does once described: the agreement's payload (count elements of
    dtype_code reduced with op_code from send into out, then divided by divisor) and move,
    run after the agreement (None: the payload is the whole call)."""

    move: Callable[[], Any] | None
    send: np.ndarray = _NO_DATA
    out: np.ndarray = _NO_DATA
    count: int = 0
    dtype_code: int = _UINT8
    op_code: int = 0
    divisor: int = 1


class Handle:
    """An in-flight collective: pass it to synchronize() for the result, poll() to ask."""

    __slots__ = ("name", "queued", "span", "_done", "_result", "_error", "_callbacks",
                 "_fired")

    def __init__(self, name: str, queued: float = -1.0):
        self.name = name
        self.queued = queued  # when it was submitted, for the timeline (-1: not recorded)
        self.span: Any = None  # its range in a torch profiler's trace, while one records
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] | None = []  # None once fired
        self._fired = threading.Event()  # its callbacks have all returned

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call fn(self) once the call has finished: on the engine's thread, after the
        engine has let go of the call, so fn may submit async calls of its own (a sync call
        from fn raises RuntimeError if other calls are queued); at once, on the caller's
        thread, if the handle's callbacks have fired already. (A handle is done, and its
        result ready for synchronize(), just before its callbacks fire: fn added in between
        still runs on the engine's thread.) The torch.distributed backend completes its
        work's futures this way."""
        with _CALLBACKS:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)

    def _fire(self) -> None:
        with _CALLBACKS:
            callbacks, self._callbacks = self._callbacks, None
        try:
            for fn in callbacks:
                try:
                    fn(self)
                except Exception:  # the engine thread must go on; the error is still shown
                    traceback.print_exc()
        finally:
            # The callbacks are freed before the handle counts as fired: freeing one can free
            # a torch future, whose C++ takes the GIL back, which must not happen while the
            # interpreter shuts down (the exit handler waits for this event).
            fn = callbacks = None
            self._fired.set()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self._result = work()
        except BaseException as exc:  # delivered to whoever synchronizes
            self._error = exc
        finally:
            self._done.set()


class Engine:
    def __init__(self) -> None:
        self.native = _C.Engine()
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last: Handle | None = None  # the call submitted last

    def run(self, topo: Communicator, call: Described, job: Job) -> Any:
        """Run the call after everything submitted before and return its result."""
        native = self.native
        if not native.try_claim():
            if threading.current_thread() is self._thread:
                raise RuntimeError(f"{call.collective}: a sync collective cannot run inside a "
                                   "completion callback of an async one while other calls "
                                   "are queued; submit it async instead")
            return self.submit(topo, call, job).wait()
        span = _begin(topo, call) if profiling.on() else None
        try:
            return _execute(native, topo, call, job)
        finally:
            native.release()
            if span is not None:
                profiling.end(span)

    def submit(self, topo: Communicator, call: Described, job: Job) -> Handle:
        """Queue the call behind everything submitted before; returns at once."""
        native = self.native
        handle = Handle(call.collective, native.clock() if native.tracing else -1.0)
        if profiling.on():
            handle.span = profiling.begin_async(topo.stats.label, call.collective,
                                                call.fields, call.algorithm)
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="collectives-engine",
                                                    daemon=True)
                    self._thread.start()
                    atexit.register(self._drain)  # before MPI is finalized (LIFO)
        self._last = handle
        native.push((handle, topo, call, job))
        return handle

    def _drain(self) -> None:
        """At exit: let the calls still queued finish (or fail, within the stall timeout)
        and their completion callbacks return (torch's futures are completed in them), as
        nobody may have waited for them. Python ends a daemon thread that takes the GIL
        back during interpreter shutdown, and this one would be inside C++ then: the
        process would abort ("terminate called without an active exception")."""
        if self._last is not None:
            self._last._fired.wait()

    def _loop(self) -> None:
        native = self.native
        while True:
            handle, topo, call, job = native.next()  # claimed for this item
            run = functools.partial(_execute, native, topo, call, job, handle.queued)
            try:
                handle._run(run if handle.span is None else
                            functools.partial(_spanned, handle.span, run))
            finally:
                native.release()
            handle._fire()


def _begin(topo: Communicator, call: Described) -> Any:
    return profiling.begin(topo.stats.label, call.collective, call.fields, call.algorithm)


def _spanned(span: Any, run: Callable[[], Any]) -> Any:
    """run(), then the end of its async profiler range: before its handle is done, so the
    range ends when the call does, not when this thread next gets the GIL."""
    try:
        return run()
    finally:
        profiling.end_async(span)


def _execute(native: Any, topo: Communicator, call: Described, job: Job, queued: float = -1.0) -> Any:
    """The call, run; a failure of ranks raised as runtime/faults.py's RanksFailedError."""
    faults.check(topo)
    try:
        return native.execute(topo.channel, call.native, job.send, job.out, job.count,
                              job.dtype_code, job.op_code, job.divisor, job.move, queued)
    except Exception as exc:
        faults.reraise(topo, exc)


ENGINE = Engine()


def contributors(size: int) -> int:
    """The ranks of a world of size whose data the running call reduces: size less the ranks
    inside join() that took part with no data (the engine's count, set by the call's
    agreement, or by `contribute` on a joined rank). An Average divides by it: one rule for
    every Average of the library, the agreement's payload (csrc/runtime/call.cpp) included."""
    return size - ENGINE.native.joined

