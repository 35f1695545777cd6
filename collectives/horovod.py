"""Horovod's PyTorch API on collectives: a Horovod script runs with one changed import,

    import collectives.horovod as hvd      # was: import horovod.torch as hvd

Same names, signatures, defaults and semantics as horovod.torch 0.28: `average=` (deprecated
there too) and `op=`, the auto-differentiable allreduce / allgather / broadcast / alltoall /
reducescatter, async handles with poll() and synchronize(), a name that is still in flight
cannot be reused, process sets, join, the timeline, DistributedOptimizer and the
broadcasts. Errors: a call that differs across ranks raises collectives.MismatchError,
which is a RuntimeError as Horovod's are (and a ValueError); HorovodInternalError is
raised when a collective cannot complete (a stall timeout)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from mpi4py import MPI

import collectives as _C
from collectives import adasum as _adasum
from collectives import meet as _meet
from collectives import process_sets as _process_sets
from collectives import topology as _topology
from collectives.compression import Compression
from collectives.engine import Handle
from collectives.ops import ReduceOp
from collectives.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from collectives.timeline import start_timeline, stop_timeline
from collectives.topology import cross_rank, cross_size, local_rank, local_size, rank, size
from optim import adasum as _optim_adasum
from optim import distributed as _optim
from optim.sync_batch_norm import SyncBatchNorm

Average, Sum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max,
                                   ReduceOp.Product)
#: Horovod's Adasum op (collectives/adasum.py).
Adasum = "Adasum"

#: Raised when a collective cannot complete (Horovod's name for it).
HorovodInternalError = _C.StallError


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's elastic-training interrupt; elastic training is not provided, so nothing
    raises it, but scripts that catch it import it."""


__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "Product", "ProcessSet", "Sum", "SyncBatchNorm",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async",
    "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled",
    "global_process_set", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async",
    "start_timeline", "stop_timeline", "synchronize",
]


# ------------------------------------------------------------------------ the job itself

def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Start (once; again after shutdown()). comm: an mpi4py communicator, or a list of
    MPI_COMM_WORLD ranks (only they call init) to run on; process_sets: sets to register."""
    if isinstance(comm, (list, tuple, range)):
        world = MPI.COMM_WORLD
        comm = world.Create_group(world.Get_group().Incl(list(comm)))
    _process_sets.init(comm, process_sets=process_sets)


def shutdown() -> None:
    _process_sets.shutdown()
    with _lock:
        _in_flight.clear()
        _started.clear()
        _outstanding.clear()


def is_initialized() -> bool:
    return _topology.initialized()


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks."""
    return len({len(node) for node in _topology.get().nodes}) == 1


def mpi_threads_supported() -> bool:
    return _meet.available()


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """False: nothing is compiled against CUDA; GPU tensors are staged through host memory
    (and reduced by CUDA kernels compiled at run time where CuPy is installed)."""
    return False


def rocm_built() -> bool:
    return False


# -------------------------------------------------------------------------- arguments

def _op(average: Any, op: Any) -> Any:
    """Horovod's rule: op supersedes the deprecated average; neither means Average."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return Sum if average is False else Average
    return op


def _set(process_set: Any) -> Any:
    return None if process_set is global_process_set else process_set


def _as_horovod(op: Any, postscale: Any, process_set: Any) -> tuple[Any, Any]:
    """Horovod's Average: a Sum scaled by postscale / size, the set's whole size even while
    some ranks have joined (they count as zeros), and integers scaled in float64 and
    truncated; so Average travels as that Sum."""
    if op is not Average:
        return op, postscale
    return Sum, postscale / _topology_of(process_set).size


_lock = threading.Lock()
# names of async calls in flight: until synchronize() or a poll() that found them finished
# (Horovod frees a name when its call finishes, which takes at least a cycle of its
# coordinator; here a call may finish within microseconds, so a name stays taken until the
# caller has seen it finish)
_in_flight: dict[str, Handle] = {}
# per process set's topology: async calls started so far, and those not known finished with
# their place in that count (what barrier() waits for)
_started: dict[Any, int] = {}
_outstanding: dict[Any, list[tuple[int, Handle]]] = {}


def _named(name: str | None, process_set: Any, start) -> Handle:
    """Start an async call under name, refusing a name still in flight (as Horovod), and
    count it for barrier()."""
    topo = _topology_of(process_set)
    with _lock:
        if name is not None and name in _in_flight:
            raise ValueError(f"Requested to collect a tensor with the same name as another "
                             f"tensor that is currently being processed ({name!r}). If you "
                             f"want to request another tensor, use a different tensor name.")
        handle = start()
        if name is not None:
            _in_flight[name] = handle
        index = _started.get(topo, 0)
        _started[topo] = index + 1
        pending = [(i, h) for i, h in _outstanding.get(topo, ()) if not h.done()]
        _outstanding[topo] = pending + [(index, handle)]
    return handle


def synchronize(handle: Handle) -> Any:
    """Wait for an async call; its result."""
    try:
        return _C.synchronize(handle)
    finally:
        _seen_finished(handle)


def poll(handle: Handle) -> bool:
    if not _C.poll(handle):
        return False
    _seen_finished(handle)
    return True


def _seen_finished(handle: Handle) -> None:
    """The caller has seen handle's call finish: its name is free again."""
    with _lock:
        for name, h in list(_in_flight.items()):
            if h is handle:
                del _in_flight[name]


def _no_adasum(op: Any, collective: str) -> None:
    if op == Adasum:  # a RuntimeError, as Horovod's
        raise NotImplementedError(f"op: {collective} does not support Adasum")


def _grad(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


# ------------------------------------------------------------------------------ allreduce

def _reduce(tensor, op, name, compression, prescale, postscale, process_set):
    if op == Adasum:
        return _adasum.allreduce(tensor, name=name, process_set=_set(process_set))
    op, postscale = _as_horovod(op, postscale, process_set)
    return _C.allreduce(tensor, op=op, compression=compression, prescale_factor=prescale,
                        postscale_factor=postscale, name=name, process_set=_set(process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, compression, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        return _reduce(tensor, op, name, compression, prescale, postscale, process_set)

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        return (allreduce(grad, op=op, prescale_factor=prescale, postscale_factor=postscale,
                          process_set=process_set), None, None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """The reduction of tensor over all ranks (a new tensor; differentiable)."""
    op = _op(average, op)
    if _grad(tensor):
        return _Allreduce.apply(tensor, op, name, compression, prescale_factor,
                                postscale_factor, process_set)
    return _reduce(tensor, op, name, compression, prescale_factor, postscale_factor,
                   process_set)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> Handle:
    op, postscale_factor = _as_horovod(_op(average, op), postscale_factor, process_set)
    return _named(name, process_set, lambda: _C.allreduce_async(
        tensor, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        name=name, process_set=_set(process_set)))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """allreduce in place; returns tensor."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> Handle:
    op, postscale_factor = _as_horovod(_op(average, op), postscale_factor, process_set)
    return _named(name, process_set, lambda: _C.allreduce_async_(
        tensor, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        name=name, process_set=_set(process_set)))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, compression, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        op, postscale = _as_horovod(op, postscale, process_set)
        return tuple(_C.grouped_allreduce(list(tensors), op=op, compression=compression,
                                          prescale_factor=prescale, postscale_factor=postscale,
                                          name=name, process_set=_set(process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        return (None,) * 6 + tuple(grouped_allreduce(
            list(grads), op=op, prescale_factor=prescale, postscale_factor=postscale,
            process_set=process_set))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> list:
    op = _op(average, op)
    if any(_grad(t) for t in tensors):
        return list(_GroupedAllreduce.apply(op, name, compression, prescale_factor,
                                            postscale_factor, process_set, *tensors))
    op, postscale_factor = _as_horovod(op, postscale_factor, process_set)
    return _C.grouped_allreduce(list(tensors), op=op, compression=compression,
                                prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, name=name,
                                process_set=_set(process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> Handle:
    op, postscale_factor = _as_horovod(_op(average, op), postscale_factor, process_set)
    return _named(name, process_set, lambda: _C.grouped_allreduce_async(
        list(tensors), op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, name=name, process_set=_set(process_set)))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set) -> list:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> Handle:
    op, postscale_factor = _as_horovod(_op(average, op), postscale_factor, process_set)
    return _named(name, process_set, lambda: _C.grouped_allreduce_async_(
        list(tensors), op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, name=name, process_set=_set(process_set)))


class _SparseHandle(Handle):
    """Horovod's sparse allreduce in flight: the allgathers of indices and values."""

    __slots__ = ("_parts", "_shape", "_scale")

    def __init__(self, indices: Handle, values: Handle, shape: torch.Size, scale: float):
        super().__init__("sparse_allreduce")
        self._parts, self._shape, self._scale = (indices, values), shape, scale

    def done(self) -> bool:
        return all(h.done() for h in self._parts)

    def __call__(self) -> torch.Tensor:
        """Horovod's sparse handle is a function returning the result."""
        return synchronize(self)

    def wait(self) -> torch.Tensor:
        indices, values = (h.wait() for h in self._parts)
        return torch.sparse_coo_tensor(indices.t(), values * self._scale, self._shape,
                                       check_invariants=False).coalesce()


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set) -> Handle:
    """The sum (op=Sum) or average (Average) of every rank's sparse tensor, as Horovod
    computes it: every rank's indices and values allgathered, then coalesced."""
    if op not in (Sum, Average):
        raise ValueError(f"op: sparse allreduce supports Sum and Average, got {op!r}")
    grad = tensor.coalesce()
    n = _topology_of(process_set).size

    def start() -> Handle:  # only once the name is known free
        parts = [_C.allgather_async(t, process_set=_set(process_set))
                 for t in (grad.indices().t().contiguous(), grad.values())]
        return _SparseHandle(*parts, tensor.shape, 1.0 / n if op == Average else 1.0)

    return _named(name, process_set, start)


# ------------------------------------------------------------------------------ allgather

class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return _C.allgather(tensor, name=name, process_set=_set(process_set))

    @staticmethod
    def backward(ctx, grad):
        """This rank's rows of the average of every rank's gradient of the result
        (Horovod's convention: gradients are averaged over the ranks)."""
        summed = allreduce(grad, op=Average, process_set=ctx.process_set)
        rows = _C.allgather(torch.tensor([ctx.rows]), process_set=_set(ctx.process_set))
        me = _topology_of(ctx.process_set).rank
        start = int(rows[:me].sum())
        return summed.narrow(0, start, ctx.rows), None, None


def _topology_of(process_set: Any):
    return _process_sets.resolve(None, _set(process_set))


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's tensor concatenated on dim 0 (differentiable)."""
    if _grad(tensor):
        return _Allgather.apply(tensor, name, process_set)
    return _C.allgather(tensor, name=name, process_set=_set(process_set))


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    return _named(name, process_set, lambda: _C.allgather_async(tensor, name=name,
                                                   process_set=_set(process_set)))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(_C.grouped_allgather(list(tensors), name=name,
                                          process_set=_set(process_set)))

    @staticmethod
    def backward(ctx, *grads):
        """Each tensor's rows of the average of every rank's gradient (as _Allgather)."""
        averaged = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        rows = _C.allgather(torch.tensor([ctx.rows]), process_set=_set(ctx.process_set))
        starts = rows[:_topology_of(ctx.process_set).rank].sum(0).tolist()
        return (None, None, *(a.narrow(0, start, count)
                              for a, start, count in zip(averaged, starts, ctx.rows)))


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    """allgather of every tensor of the list in one call (differentiable)."""
    if any(_grad(t) for t in tensors):
        return list(_GroupedAllgather.apply(name, process_set, *tensors))
    return _C.grouped_allgather(list(tensors), name=name, process_set=_set(process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> Handle:
    return _named(name, process_set, lambda: _C.grouped_allgather_async(list(tensors), name=name,
                                                           process_set=_set(process_set)))


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    return _C.allgather_object(obj, name=name, process_set=_set(process_set))


# ------------------------------------------------------------------------------ broadcast

class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _C.broadcast(tensor, root_rank=root_rank, name=name,
                            process_set=_set(process_set))

    @staticmethod
    def backward(ctx, grad):
        """The average of every rank's gradient on the root; zeros elsewhere (Horovod's)."""
        summed = allreduce(grad, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            summed = torch.zeros_like(summed)
        return summed, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """root_rank's tensor on every rank (a new tensor; differentiable)."""
    if _grad(tensor):
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return _C.broadcast(tensor, root_rank=root_rank, name=name, process_set=_set(process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    return _named(name, process_set, lambda: _C.broadcast_async(tensor, root_rank=root_rank, name=name,
                                                   process_set=_set(process_set)))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    return _named(name, process_set, lambda: _C.broadcast_async_(tensor, root_rank=root_rank, name=name,
                                                    process_set=_set(process_set)))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    return _C.broadcast_object(obj, root_rank=root_rank, name=name,
                               process_set=_set(process_set))


# ------------------------------------------------------------------------------- alltoall

class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.process_set = process_set
        out, received = _C.alltoall(tensor, splits=splits, name=name,
                                    process_set=_set(process_set))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        """Each row's gradient goes back to the rank it came from."""
        back, _ = _C.alltoall(grad.contiguous(), splits=ctx.received,
                              process_set=_set(ctx.process_set))
        return back, None, None, None


def _splits_or_even(tensor, splits, process_set):
    if splits is not None:
        return splits
    n = _topology_of(process_set).size
    rows = tensor.shape[0] if tensor.dim() else 0
    if rows % n:
        raise ValueError(f"tensor: dim 0 ({rows}) must be divisible by the {n} ranks when "
                         "splits is not given")
    return [rows // n] * n


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows splits[j] of tensor to rank j; the rows received (and, with splits, how many
    came from each rank). Differentiable."""
    if _grad(tensor):
        out, received = _Alltoall.apply(tensor, _splits_or_even(tensor, splits, process_set),
                                        name, process_set)
        return out if splits is None else (out, received)
    return _C.alltoall(tensor, splits=splits, name=name, process_set=_set(process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    return _named(name, process_set, lambda: _C.alltoall_async(tensor, splits=splits, name=name,
                                                  process_set=_set(process_set)))


# -------------------------------------------------------------------------- reducescatter

class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        return _C.reducescatter(tensor, op=op, prescale_factor=prescale,
                                postscale_factor=postscale, name=name,
                                process_set=_set(process_set))

    @staticmethod
    def backward(ctx, grad):
        """Every rank's part of the gradient, gathered; scaled by the factors and, for Sum,
        by the number of ranks (Horovod's convention: gradients are averaged)."""
        op, prescale, postscale, process_set = ctx.args
        scale = prescale * postscale * (_topology_of(process_set).size if op == Sum else 1)
        return (_C.allgather((grad * scale).contiguous(), process_set=_set(process_set)),
                None, None, None, None, None)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """This rank's rows of the reduction over all ranks (differentiable)."""
    _no_adasum(op, "reducescatter")
    if compression is not Compression.none:
        raise ValueError("compression: reducescatter supports Compression.none only")
    if _grad(tensor):
        return _Reducescatter.apply(tensor, op, name, prescale_factor, postscale_factor,
                                    process_set)
    return _C.reducescatter(tensor, op=op, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, name=name,
                            process_set=_set(process_set))


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> Handle:
    _no_adasum(op, "reducescatter")
    return _named(name, process_set, lambda: _C.reducescatter_async(
        tensor, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        name=name, process_set=_set(process_set)))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(_C.grouped_reducescatter(list(tensors), op=op, prescale_factor=prescale,
                                              postscale_factor=postscale, name=name,
                                              process_set=_set(process_set)))

    @staticmethod
    def backward(ctx, *grads):
        """As _Reducescatter's, for every tensor in one grouped allgather."""
        op, prescale, postscale, process_set = ctx.args
        scale = prescale * postscale * (_topology_of(process_set).size if op == Sum else 1)
        return (None,) * 5 + tuple(_C.grouped_allgather(
            [(g * scale).contiguous() for g in grads], process_set=_set(process_set)))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    _no_adasum(op, "reducescatter")
    if compression is not Compression.none:
        raise ValueError("compression: grouped_reducescatter supports Compression.none only")
    if any(_grad(t) for t in tensors):
        return list(_GroupedReducescatter.apply(op, name, prescale_factor, postscale_factor,
                                                process_set, *tensors))
    return _C.grouped_reducescatter(list(tensors), op=op, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, name=name,
                                    process_set=_set(process_set))


def grouped_reducescatter_async(tensors, name=None, op=Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> Handle:
    _no_adasum(op, "reducescatter")
    return _named(name, process_set, lambda: _C.grouped_reducescatter_async(
        list(tensors), op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, name=name, process_set=_set(process_set)))


# ------------------------------------------------------------------- join, barrier, more

def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' allreduces until every rank
    has joined; returns the last rank to join. device: Horovod's, unused (no GPU queues)."""
    return _C.join()


def barrier(process_set=global_process_set) -> None:
    """Every rank of the set reaches this point before any leaves, and the async calls that
    every rank started before it have finished. As Horovod's (whose coordinator runs the
    barrier after the calls ready on every rank), it is not held up by a call that only
    some ranks have started, even one the others start only after it: the ranks meet
    beside the engine (collectives/meet.py), agreeing on how many async calls all of them
    started, and then wait for those. Below MPI_THREAD_MULTIPLE it is the library's
    barrier, behind every outstanding call."""
    if not _meet.available():
        _C.barrier(process_set=_set(process_set))
        return
    topo = _topology_of(process_set)
    with _lock:
        started = _started.get(topo, 0)
        pending = list(_outstanding.get(topo, ()))
    everyone = _meet.meet(topo, started)
    for index, handle in pending:
        if index < everyone:
            try:
                handle.wait()  # its error, if any, stays for synchronize()
            except Exception:  # the caller's synchronize() raises it
                pass


def broadcast_parameters(params, root_rank, process_set=global_process_set) -> None:
    _optim.broadcast_parameters(params, root_rank, process_set=_set(process_set))


def broadcast_optimizer_state(optimizer, root_rank, model=None,
                              process_set=global_process_set) -> None:
    """root_rank's optimizer state and hyper-parameters on every rank. model: Horovod's,
    not needed here (state an optimizer creates lazily arrives by load_state_dict). As
    Horovod's (which takes a zero-gradient step), it leaves every trainable parameter
    without a gradient with a zero one."""
    _optim.broadcast_optimizer_state(optimizer, root_rank, process_set=_set(process_set))
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 (Horovod's name)
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set):
    """optim.DistributedOptimizer with Horovod's signature (a torch.optim.Optimizer) and
    Horovod's averaging: under join(), over every rank of the set, joined ones adding
    zeros."""
    if op == Adasum:
        return _optim_adasum.DistributedAdasumOptimizer(
            optimizer, named_parameters=named_parameters,
            backward_passes_per_step=backward_passes_per_step, process_set=_set(process_set))
    return _optim.DistributedOptimizer(
        optimizer, named_parameters=named_parameters, compression=compression,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
        groups=groups, sparse_as_dense=sparse_as_dense, process_set=_set(process_set),
        divide_by_initial_world_size=True)

