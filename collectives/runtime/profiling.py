"""Collectives in PyTorch's profiler: while a torch.profiler (or autograd profiler) records,
every call the engine runs is a range named `collectives.<collective>` (collectives.
allreduce, collectives.broadcast, ...), so communication shows against compute in the
trace torch exports, which TensorBoard's profiler plugin and Perfetto open. Everything the
library offers runs through the engine (the public calls, DistributedOptimizer,
ZeroOptimizer, the DDP hooks, the torch backend), so all of it shows.

A sync call's range carries the call's dtype, shape, bytes (of this rank's input, where its
shape says), op, name, algorithm and process set (the communicator's label,
runtime/flight.py), which torch writes into the trace when the profiler records shapes
(record_shapes=True); an async call's range carries them as text torch's export leaves out. A
sync call's range is the call on the caller's thread; an async call's begins on the caller's
thread at submission and ends when the engine's thread has run it, so it spans the time
queued and run (the bucket allreduces of a DDP step show against the backward they overlap).

Cost when no profiler runs: one attribute read per call (torch's flag, once torch is
imported; nothing while it is not). The allreduce fast entry steps aside while one runs,
so those calls show as well."""

from __future__ import annotations

import math
import sys
from typing import Any

from collectives.dtypes import STORAGE

_flags: Any = None  # torch.autograd.profiler, once imported: its _is_profiler_enabled


def on() -> bool:
    """Whether a torch profiler is recording."""
    global _flags
    if _flags is None:
        _flags = sys.modules.get("torch.autograd.profiler")
        if _flags is None:
            return False
    return _flags._is_profiler_enabled


def _args(process_set: str, fields: tuple, algorithm: str) -> dict[str, Any]:
    """What a range shows of a call."""
    described = dict(fields)
    args: dict[str, Any] = {"algorithm": algorithm, "process_set": process_set}
    for key in ("op", "dtype", "name"):
        if key in described:
            args[key] = str(described[key])
    shapes = described.get("shapes") or ((described["shape"],) if "shape" in described
                                         else None)
    if shapes is not None:
        args["shape"] = str(shapes[0] if len(shapes) == 1 else shapes)
        dtype = STORAGE.get(str(described.get("dtype")))
        if dtype is not None:
            args["bytes"] = sum(math.prod(s) for s in shapes) * dtype.itemsize
    return args


def begin(process_set: str, collective: str, fields: tuple, algorithm: str) -> Any:
    """Open a sync call's range on this thread (only while on()): a handle for end()."""
    torch = sys.modules["torch"]  # imported: on() found its profiler
    span = torch._C._profiler._RecordFunctionFast(f"collectives.{collective}", (),
                                                  _args(process_set, fields, algorithm))
    span.__enter__()
    return span


def end(span: Any) -> None:
    """Close a range begin() opened, on the thread that opened it."""
    span.__exit__(None, None, None)


def begin_async(process_set: str, collective: str, fields: tuple, algorithm: str) -> Any:
    """Open an async call's range on the submitting thread (only while on()): a future that
    closes it when end_async() completes it, from any thread (torch's pattern for ranges
    over futures, record_function._call_end_callbacks_on_future: the range keeps the
    opening thread's profiler state). Such a range carries the call's arguments as text,
    which torch keeps but its trace export leaves out."""
    torch = sys.modules["torch"]
    args = _args(process_set, fields, algorithm)
    record = torch.ops.profiler._record_function_enter_new(
        f"collectives.{collective}", ", ".join(f"{k}={v}" for k, v in args.items()))
    done = torch.futures.Future()
    torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction(record, done)
    return done


def end_async(done: Any) -> None:
    """Close the range begin_async() opened."""
    done.set_result(None)
