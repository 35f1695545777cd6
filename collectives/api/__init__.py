"""The public API: every collective (validate, wrap, describe, submit), by family, and the
features built on them (process sets, join, timeline, stats, the flight recorder's dumps,
Adasum, 1-bit).

Owns: call descriptions (calls.py), the process-set registry, the timeline's recording.
May import: leaves, kernels, runtime, algorithms, auto, compression.

A collective checks its arguments and wraps the caller's buffers in the caller's thread,
describes the call (calls.py: agreed fields, digest, concrete algorithm) and hands the
engine a Job: the agreement's payload and the data movement to run once every rank is known
to make the same call. Every call takes `comm` (an mpi4py communicator; default: the job's)
or `process_set`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from collectives.api.allreduce import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from collectives.api.base import ALGORITHMS, poll, refuse, synchronize
from collectives.api.compressed import (
    compressed_allreduce,
    compressed_allreduce_async,
    compressed_reducescatter,
    compressed_reducescatter_async,
    grouped_compressed_allreduce,
    grouped_compressed_allreduce_async,
)
from collectives.api.gather import (
    allgather,
    allgather_async,
    allgather_object,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather,
    grouped_allgather_async,
)
from collectives.api.join import join
from collectives.api.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    init,
    remove_process_set,
    shutdown,
)
from collectives.api.record import dump_flight_recorder
from collectives.api.reducescatter import (
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from collectives.api.stats import stats
from collectives.api.timeline import start_timeline, stop_timeline
from collectives.auto import autotune
from collectives.compression import Compression
from collectives.ops import Average, Max, Min, Product, ReduceOp, Sum
from collectives.runtime import topology
from collectives.runtime.agreement import MismatchError
from collectives.runtime.engine import Handle
from collectives.runtime.faults import RanksFailedError
from collectives.runtime.topology import (
    cross_rank,
    cross_size,
    local_rank,
    local_size,
    rank,
    size,
)
from collectives.runtime.watchdog import StallError


def timed_call(collective: str, x: np.ndarray, algo: str,
               name: str | None = None) -> Callable[[], Any]:
    """One public call of collective on x with algo (Sum for the reductions): what `auto`'s
    measurements time (autotune.Timed), since it is what `auto` will run. A named
    allreduce runs the general path even where the call has a fast entry."""
    return {
        "allreduce": lambda: allreduce(x, ReduceOp.Sum, algo, name=name),
        "allgather": lambda: allgather(x, algo),
        "reducescatter": lambda: reducescatter(x, ReduceOp.Sum, algo),
        "broadcast": lambda: broadcast(x, 0, algo),
    }[collective]


# every init measures (or reads the cached measurement of) this setup for `auto`
topology.on_init(lambda topo: autotune.install(topo, timed_call))

__all__ = [
    "ALGORITHMS", "Average", "Compression", "Handle", "Max", "Min", "MismatchError",
    "ProcessSet", "Product", "RanksFailedError", "ReduceOp", "StallError", "Sum",
    "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "compressed_allreduce", "compressed_allreduce_async", "compressed_reducescatter",
    "compressed_reducescatter_async", "cross_rank", "cross_size", "dump_flight_recorder",
    "global_process_set", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_compressed_allreduce",
    "grouped_compressed_allreduce_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "init", "join", "local_rank", "local_size", "poll", "rank", "reducescatter",
    "reducescatter_async", "refuse", "remove_process_set", "shutdown", "size",
    "start_timeline", "stats", "stop_timeline", "synchronize", "timed_call",
]
