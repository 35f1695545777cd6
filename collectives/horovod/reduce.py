"""allreduce (dense, grouped, sparse) and reducescatter, Horovod's way: differentiable,
async under names, Average as Horovod computes it."""

from __future__ import annotations

import torch

from collectives import api as _C
from collectives.api import adasum as _adasum
from collectives.api.process_sets import (
    global_process_set,
)
from collectives.compression import Compression
from collectives.horovod.common import (
    Adasum,
    Average,
    Sum,
    as_horovod,
    op_of,
    refuse_adasum,
    set_of,
    start_named,
    synchronize,
    topology_of,
    wants_grad,
)
from collectives.runtime.engine import Handle

__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "reducescatter",
    "reducescatter_async", "sparse_allreduce_async",
]


# ------------------------------------------------------------------------------ allreduce


def _reduce(tensor, op, name, compression, prescale, postscale, process_set):
    if op == Adasum:
        return _adasum.allreduce(tensor, name=name, process_set=set_of(process_set))
    op, postscale = as_horovod(op, postscale, process_set)
    return _C.allreduce(tensor, op=op, compression=compression, prescale_factor=prescale,
                        postscale_factor=postscale, name=name, process_set=set_of(process_set))


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
    op = op_of(average, op)
    if wants_grad(tensor):
        return _Allreduce.apply(tensor, op, name, compression, prescale_factor,
                                postscale_factor, process_set)
    return _reduce(tensor, op, name, compression, prescale_factor, postscale_factor,
                   process_set)


def _started(start, data, average, name, op, prescale_factor, postscale_factor,
             process_set) -> Handle:
    """An async reduction started under name: start (one of the api's *_async calls) of
    data, with op and scaling in Horovod's arithmetic (as_horovod)."""
    op, postscale_factor = as_horovod(op_of(average, op), postscale_factor, process_set)
    return start_named(name, process_set, lambda: start(
        data, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        name=name, process_set=set_of(process_set)))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> Handle:
    return _started(_C.allreduce_async, tensor, average, name, op, prescale_factor,
                    postscale_factor, process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """allreduce in place; returns tensor."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> Handle:
    return _started(_C.allreduce_async_, tensor, average, name, op, prescale_factor,
                    postscale_factor, process_set)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, compression, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        op, postscale = as_horovod(op, postscale, process_set)
        return tuple(_C.grouped_allreduce(list(tensors), op=op, compression=compression,
                                          prescale_factor=prescale, postscale_factor=postscale,
                                          name=name, process_set=set_of(process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        return (None,) * 6 + tuple(grouped_allreduce(
            list(grads), op=op, prescale_factor=prescale, postscale_factor=postscale,
            process_set=process_set))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> list:
    op = op_of(average, op)
    if any(wants_grad(t) for t in tensors):
        return list(_GroupedAllreduce.apply(op, name, compression, prescale_factor,
                                            postscale_factor, process_set, *tensors))
    op, postscale_factor = as_horovod(op, postscale_factor, process_set)
    return _C.grouped_allreduce(list(tensors), op=op, compression=compression,
                                prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, name=name,
                                process_set=set_of(process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> Handle:
    return _started(_C.grouped_allreduce_async, list(tensors), average, name, op,
                    prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set) -> list:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> Handle:
    return _started(_C.grouped_allreduce_async_, list(tensors), average, name, op,
                    prescale_factor, postscale_factor, process_set)


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
    n = topology_of(process_set).size

    def start() -> Handle:  # only once the name is known free
        parts = [_C.allgather_async(t, process_set=set_of(process_set))
                 for t in (grad.indices().t().contiguous(), grad.values())]
        return _SparseHandle(*parts, tensor.shape, 1.0 / n if op == Average else 1.0)

    return start_named(name, process_set, start)


# -------------------------------------------------------------------------- reducescatter

class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, prescale, postscale, process_set, compression):
        ctx.args = (op, prescale, postscale, process_set)
        return _C.reducescatter(tensor, op=op, compression=compression,
                                prescale_factor=prescale, postscale_factor=postscale,
                                name=name, process_set=set_of(process_set))

    @staticmethod
    def backward(ctx, grad):
        """Every rank's part of the gradient, gathered; scaled by the factors and, for Sum,
        by the number of ranks (Horovod's convention: gradients are averaged)."""
        op, prescale, postscale, process_set = ctx.args
        scale = prescale * postscale * (topology_of(process_set).size if op == Sum else 1)
        return (_C.allgather((grad * scale).contiguous(), process_set=set_of(process_set)),
                None, None, None, None, None, None)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """This rank's rows of the reduction over all ranks (differentiable); compression
    (fp16, int8) compresses what travels."""
    refuse_adasum(op, "reducescatter")
    if wants_grad(tensor):
        return _Reducescatter.apply(tensor, op, name, prescale_factor, postscale_factor,
                                    process_set, compression)
    return _C.reducescatter(tensor, op=op, compression=compression,
                            prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, name=name,
                            process_set=set_of(process_set))


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> Handle:
    refuse_adasum(op, "reducescatter")
    return start_named(name, process_set, lambda: _C.reducescatter_async(
        tensor, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        name=name, process_set=set_of(process_set)))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(_C.grouped_reducescatter(list(tensors), op=op, prescale_factor=prescale,
                                              postscale_factor=postscale, name=name,
                                              process_set=set_of(process_set)))

    @staticmethod
    def backward(ctx, *grads):
        """As _Reducescatter's, for every tensor in one grouped allgather."""
        op, prescale, postscale, process_set = ctx.args
        scale = prescale * postscale * (topology_of(process_set).size if op == Sum else 1)
        return (None,) * 5 + tuple(_C.grouped_allgather(
            [(g * scale).contiguous() for g in grads], process_set=set_of(process_set)))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    refuse_adasum(op, "reducescatter")
    if compression is not Compression.none:
        raise ValueError("compression: grouped_reducescatter supports Compression.none only")
    if any(wants_grad(t) for t in tensors):
        return list(_GroupedReducescatter.apply(op, name, prescale_factor, postscale_factor,
                                                process_set, *tensors))
    return _C.grouped_reducescatter(list(tensors), op=op, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, name=name,
                                    process_set=set_of(process_set))


def grouped_reducescatter_async(tensors, name=None, op=Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> Handle:
    refuse_adasum(op, "reducescatter")
    return start_named(name, process_set, lambda: _C.grouped_reducescatter_async(
        list(tensors), op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, name=name, process_set=set_of(process_set)))


