"""The torch objects a backend call returns: `Work`s and their futures, over our calls'
handles (async), over values already computed (sync), and over MPI requests (send/recv)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from collectives.runtime.engine import Handle

_Class = TypeVar("_Class", bound=type)


def eager_methods(cls: _Class) -> _Class:
    """cls with every method of its own run as torch's C++ backends run: never traced or
    compiled by dynamo, nor anything they call. torch calls a group's methods from C++
    (DDP's buffer broadcast, its reducer, functional collectives), sometimes while a
    torch.compile'd function is running eagerly past a graph break (DDP's forward under
    `torch.compile(DDP(model))`): dynamo would then compile the method as a frame of its
    own, where the group is an opaque object that exposes only rank, size and its name,
    and fail on the first other attribute. `torch._disable_dynamo` is the lazy form of
    `torch.compiler.disable` that torch uses for its own Python around collectives: it
    imports dynamo at the first call, not at ours."""
    for name, member in list(vars(cls).items()):
        if callable(member) and not isinstance(member, type):
            setattr(cls, name, torch._disable_dynamo(member))
    return cls


def done(value: Any) -> Future:
    """A torch future that already holds value."""
    future = Future()
    future.set_result(value)
    return future


#: What a sync call returns: torch's sync calls only wait() on it, and it is done. One object
#: for every call (a work of its own would add an object and its future to every call, a
#: visible share of a small all_reduce); its future holds no value (an async call's holds
#: the tensors).
DONE = _create_work_from_future(done([]))


def future(handle: Handle, finish: Any = None) -> Future:
    """A torch future of an async call: it gets the call's result, or finish(result), or
    the call's error, on the engine's thread once the call is done. The error is the
    future's error in C++ too (a RuntimeError with the call's message when waited on):
    torch's set_exception only stores the exception as a value there, which DDP's reducer
    would unpack as the reduced gradients."""
    outcome = Future()

    def complete(done: Handle) -> None:
        try:
            outcome.set_result((True, done.wait() if finish is None else finish(done.wait())))
        except BaseException as exc:
            outcome.set_result((False, exc))

    handle.add_done_callback(complete)
    return outcome.then(_unwrap)


def _unwrap(outcome: Future) -> Any:
    ok, value = outcome.value()
    if not ok:
        raise value
    return value


def pending(handle: Handle, finish: Any) -> dist.Work:
    """The work of an async call: its future gets finish(the call's result)."""
    return _create_work_from_future(future(handle, finish))


@eager_methods
class Request(dist._Work):
    """Work over an MPI request of send/recv: wait() completes it and, for a device tensor
    received through host memory, copies it in."""

    def __init__(self, request: MPI.Request, tensors: list, finish: Any = None):
        super().__init__()
        self._request, self._tensors, self._finish = request, tensors, finish
        self._source = -1

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._request != MPI.REQUEST_NULL:
            status = MPI.Status()
            self._request.Wait(status)
            self._source = status.Get_source()
            if self._finish is not None:
                self._finish()
        return True

    def is_completed(self) -> bool:
        return self._request == MPI.REQUEST_NULL or bool(self._request.Test())

    def get_future(self) -> Future:
        self.wait()
        return done(self._tensors)

    def _source_rank(self) -> int:
        return self._source
