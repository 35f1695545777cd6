"""Collectives in PyTorch's profiler: while a torch.profiler (or autograd profiler) records,
every call the engine runs is a range named `collectives.<collective>` (collectives.
allreduce, collectives.broadcast, ...), so communication shows against compute in the
trace torch exports, which TensorBoard's profiler plugin and Perfetto open. Everything the
library offers runs through the engine (the public calls, DistributedOptimizer,
ZeroOptimizer, the DDP hooks, the torch backend), so all of it shows.

A range carries the call's dtype, shape, bytes (of this rank's input, where its shape says),
op, name, algorithm and process set (the communicator's label, runtime/flight.py); torch
writes such values into the trace when the profiler records shapes (record_shapes=True). A
sync call's range is the call on the caller's thread; an async call's begins on the caller's
thread at submission and ends when the call has finished on the engine's thread, so it
spans the time queued and run, as torch's own ranges over futures do.

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


def begin(process_set: str, collective: str, fields: tuple, algorithm: str) -> Any:
    """Open the range of a call (only while on()): a handle for end()."""
    torch = sys.modules["torch"]  # imported: on() found its profiler
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
    span = torch._C._profiler._RecordFunctionFast(f"collectives.{collective}", (), args)
    span.__enter__()
    return span


def end(span: Any) -> None:
    """Close a range begin() opened (any thread)."""
    span.__exit__(None, None, None)
