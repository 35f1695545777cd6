"""allgather, broadcast, alltoall and the object collectives, Horovod's way:
differentiable, async under names."""

from __future__ import annotations

import torch

from collectives import api as _C
from collectives.api.process_sets import (
    global_process_set,
)
from collectives.horovod.common import Average, set_of, start_named, synchronize, topology_of, wants_grad
from collectives.horovod.reduce import allreduce, grouped_allreduce
from collectives.runtime.engine import Handle
from collectives.runtime.topology import rank

__all__ = [
    "allgather", "allgather_async", "allgather_object", "alltoall", "alltoall_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "grouped_allgather", "grouped_allgather_async",
]


# ------------------------------------------------------------------------------ allgather


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return _C.allgather(tensor, name=name, process_set=set_of(process_set))

    @staticmethod
    def backward(ctx, grad):
        """This rank's rows of the average of every rank's gradient of the result
        (Horovod's convention: gradients are averaged over the ranks)."""
        summed = allreduce(grad, op=Average, process_set=ctx.process_set)
        rows = _C.allgather(torch.tensor([ctx.rows]), process_set=set_of(ctx.process_set))
        me = topology_of(ctx.process_set).rank
        start = int(rows[:me].sum())
        return summed.narrow(0, start, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's tensor concatenated on dim 0 (differentiable)."""
    if wants_grad(tensor):
        return _Allgather.apply(tensor, name, process_set)
    return _C.allgather(tensor, name=name, process_set=set_of(process_set))


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    return start_named(name, process_set, lambda: _C.allgather_async(tensor, name=name,
                                                   process_set=set_of(process_set)))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(_C.grouped_allgather(list(tensors), name=name,
                                          process_set=set_of(process_set)))

    @staticmethod
    def backward(ctx, *grads):
        """Each tensor's rows of the average of every rank's gradient (as _Allgather)."""
        averaged = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        rows = _C.allgather(torch.tensor([ctx.rows]), process_set=set_of(ctx.process_set))
        starts = rows[:topology_of(ctx.process_set).rank].sum(0).tolist()
        return (None, None, *(a.narrow(0, start, count)
                              for a, start, count in zip(averaged, starts, ctx.rows)))


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    """allgather of every tensor of the list in one call (differentiable)."""
    if any(wants_grad(t) for t in tensors):
        return list(_GroupedAllgather.apply(name, process_set, *tensors))
    return _C.grouped_allgather(list(tensors), name=name, process_set=set_of(process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> Handle:
    return start_named(name, process_set, lambda: _C.grouped_allgather_async(list(tensors), name=name,
                                                           process_set=set_of(process_set)))


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    return _C.allgather_object(obj, name=name, process_set=set_of(process_set))


# ------------------------------------------------------------------------------ broadcast

class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _C.broadcast(tensor, root_rank=root_rank, name=name,
                            process_set=set_of(process_set))

    @staticmethod
    def backward(ctx, grad):
        """The average of every rank's gradient on the root; zeros elsewhere (Horovod's)."""
        summed = allreduce(grad, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            summed = torch.zeros_like(summed)
        return summed, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """root_rank's tensor on every rank (a new tensor; differentiable)."""
    if wants_grad(tensor):
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return _C.broadcast(tensor, root_rank=root_rank, name=name, process_set=set_of(process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    return start_named(name, process_set, lambda: _C.broadcast_async(tensor, root_rank=root_rank, name=name,
                                                   process_set=set_of(process_set)))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    return start_named(name, process_set, lambda: _C.broadcast_async_(tensor, root_rank=root_rank, name=name,
                                                    process_set=set_of(process_set)))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    return _C.broadcast_object(obj, root_rank=root_rank, name=name,
                               process_set=set_of(process_set))


# ------------------------------------------------------------------------------- alltoall

class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.process_set = process_set
        out, received = _C.alltoall(tensor, splits=splits, name=name,
                                    process_set=set_of(process_set))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        """Each row's gradient goes back to the rank it came from."""
        back, _ = _C.alltoall(grad.contiguous(), splits=ctx.received,
                              process_set=set_of(ctx.process_set))
        return back, None, None, None


def _splits_or_even(tensor, splits, process_set):
    if splits is not None:
        return splits
    n = topology_of(process_set).size
    rows = tensor.shape[0] if tensor.dim() else 0
    if rows % n:
        raise ValueError(f"tensor: dim 0 ({rows}) must be divisible by the {n} ranks when "
                         "splits is not given")
    return [rows // n] * n


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows splits[j] of tensor to rank j; the rows received (and, with splits, how many
    came from each rank). Differentiable."""
    if wants_grad(tensor):
        out, received = _Alltoall.apply(tensor, _splits_or_even(tensor, splits, process_set),
                                        name, process_set)
        return out if splits is None else (out, received)
    return _C.alltoall(tensor, splits=splits, name=name, process_set=set_of(process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    return start_named(name, process_set, lambda: _C.alltoall_async(tensor, splits=splits, name=name,
                                                  process_set=set_of(process_set)))


