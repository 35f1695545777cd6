"""collectives: MPI collective communication for data-parallel training.

    import collectives as C
    C.init()
    y = C.allreduce(x, op=C.Average)        # x: NumPy array, torch tensor or CuPy array
"""

import importlib.util

from . import mpi_defaults  # noqa: F401  (before anything starts MPI)
from .agreement import MismatchError
from .api import (
    ALGORITHMS,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
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
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from .compression import Compression
from .engine import Handle
from .join import join
from .onebit import compressed_allreduce
from .ops import Average, Max, Min, Product, ReduceOp, Sum
from .process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    init,
    remove_process_set,
    shutdown,
)
from .stats import stats
from .timeline import start_timeline, stop_timeline
from .topology import cross_rank, cross_size, local_rank, local_size, rank, size
from .watchdog import StallError

if importlib.util.find_spec("torch") is not None:  # torch is optional
    from . import torch_backend

    torch_backend.register()

# after the rest: it registers the measurement `auto` runs at init with topology.on_init
from . import autotune  # noqa: E402, F401

__all__ = [
    "ALGORITHMS", "Average", "Compression", "Handle", "Max", "Min", "MismatchError",
    "ProcessSet", "Product", "ReduceOp", "StallError", "Sum", "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "compressed_allreduce", "cross_rank", "cross_size", "global_process_set",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "join", "local_rank",
    "local_size", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "shutdown", "size", "start_timeline", "stats", "stop_timeline",
    "synchronize",
]
