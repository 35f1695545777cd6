"""Horovod's PyTorch API on collectives: a Horovod script runs with one changed import,

    import collectives.horovod as hvd      # was: import horovod.torch as hvd

Same names, signatures, defaults and semantics as horovod.torch 0.28: `average=` (deprecated
there too) and `op=`, the auto-differentiable allreduce / allgather / broadcast / alltoall /
reducescatter, async handles with poll() and synchronize(), a name that is still in flight
cannot be reused, process sets, join, the timeline, DistributedOptimizer and the
broadcasts, elastic training (`hvd.elastic`: run, State, ObjectState, TorchState,
ElasticSampler, under `mpirun --with-ft ulfm`). Errors: a call that differs across ranks
raises collectives.MismatchError, which is a RuntimeError as Horovod's are (and a
ValueError); HorovodInternalError is raised when a collective cannot complete (a stall
timeout, or ranks that died).

The drop-in stands above everything but the facade: common.py (ops, argument rules,
names in flight), job.py (init, flags), reduce.py, gather.py, optimizer.py.
May import: every layer below it (api, optim, integrations and what they stand on)."""

from __future__ import annotations

from collectives import elastic  # noqa: F401 (hvd.elastic: Horovod's elastic names)
from collectives.api.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set  # noqa: F401
from collectives.api.timeline import start_timeline, stop_timeline  # noqa: F401
from collectives.compression import Compression  # noqa: F401
from collectives.horovod import gather, reduce
from collectives.horovod.common import (  # noqa: F401
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    Product,
    Sum,
    barrier,
    join,
    poll,
    synchronize,
)
from collectives.horovod.gather import *  # noqa: F403 (the names in gather.__all__)
from collectives.horovod.job import (  # noqa: F401
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
    shutdown,
)
from collectives.horovod.optimizer import (  # noqa: F401
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from collectives.horovod.reduce import *  # noqa: F403 (the names in reduce.__all__)
from collectives.integrations.sync_batch_norm import SyncBatchNorm  # noqa: F401
from collectives.runtime.topology import cross_rank, cross_size, local_rank, local_size, rank, size  # noqa: F401

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "Product", "ProcessSet", "Sum", "SyncBatchNorm",
    "add_process_set", "barrier", "broadcast_optimizer_state", "broadcast_parameters",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built",
    "gloo_enabled", "global_process_set", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank", "remove_process_set", "rocm_built", "shutdown", "size",
    "start_timeline", "stop_timeline", "synchronize",
    *gather.__all__, *reduce.__all__,
]
