"""How an allreduce agrees and moves (plan, run: the general path uses them too), and the
fast entry: a contiguous host NumPy array or CPU torch tensor without compression skips the
general path's staging and closures, and everything derived from the call's arguments
(signature digest, kernel codes, the concrete algorithm) is kept per distinct (dtype,
shape, op, algorithm). Horovod-style code allreduces many small tensors
(loss, metrics, counters), so per-call overhead here is what users feel. An allreduce of at
most agreement.PIGGYBACK_BYTES under `tree` is reduced inside its own agreement exchange.
Results are the same bits as the general path's: the same exchange and algorithms."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from . import agreement, algorithms, kernels, select, stats, topology
from .agreement import PIGGYBACK_BYTES, digest, exchange_digest
from .buffers import numpy_dtype_name, torch_dtype_name
from .compression import Compression
from .engine import ENGINE
from .ops import ReduceOp, kernel_op

try:
    import torch
except ImportError:
    torch = None

_NO_DATA = np.empty(0, np.uint8)
_UINT8 = kernels.DTYPE_CODES["uint8"]


class _Plan(NamedTuple):
    fields: tuple
    digest: int
    dtype: str
    dtype_code: int
    algo: str              # concrete algorithm
    piggyback: bool        # data rides in the agreement exchange (tree, small)
    op: ReduceOp           # kernel op (Average moves as Sum)
    op_code: int
    divisor: int           # world size for Average, else 1
    count: int             # elements
    counter: list[int]     # stats of (allreduce, algo)
    topo: topology.Topology
    small: Any             # piggyback: the whole fast entry in C++ (_C.SmallAllreduce)


#: The fast entry's cache: per op code, by (NumPy dtype, shape, algorithm); a plan of an
#: older topology is replaced.
_plans: list[dict[tuple, _Plan | None]] = [{} for _ in ReduceOp]


@functools.lru_cache(maxsize=4096)
def plan(dtype: str, shape: tuple, nbytes: int, op: ReduceOp, algorithm: str,
         compression: str, topo: topology.Topology) -> _Plan:
    """Everything an allreduce of these arguments derives from them (raises the argument
    errors the general path would, e.g. shm on several nodes)."""
    if algorithm == "auto":
        algo = select.choose("allreduce", nbytes, topo)
    else:
        algorithms.check(algorithm, topo)
        algo = algorithm
    fields = (("op", op.name), ("dtype", dtype), ("shape", shape), ("algorithm", algorithm),
              ("compression", compression))
    kop = kernel_op(op)
    sig, code = digest(("allreduce", fields)), kernels.DTYPE_CODES[dtype]
    count, divisor = nbytes // kernels.STORAGE[dtype].itemsize, topo.size if op is ReduceOp.Average else 1
    counter = stats.counter("allreduce", algo)
    piggyback = algo == "tree" and nbytes <= PIGGYBACK_BYTES
    small = None
    if piggyback:
        small = kernels._C.SmallAllreduce(
            agreement.channel(topo), sig, count, code, int(kop), divisor, "allreduce", fields,
            topo.watchdog, counter, stats.totals(), *ENGINE.inline_claim(),
            functools.partial(agreement.raise_mismatch, topo, "allreduce", fields))
    return _Plan(fields, sig, dtype, code, algo, piggyback, kop, int(kop), divisor, count,
                 counter, topo, small)


def run(p: _Plan, topo: topology.Topology, send: np.ndarray, recv: np.ndarray) -> None:
    """Agree on the call and reduce C-contiguous send into recv of its shape (recv may be
    send) as planned; counted in stats. Used by the fast entry below and by the general
    path."""
    if p.piggyback:
        moved = exchange_digest(topo, "allreduce", p.fields, p.digest, send, recv, p.count,
                                p.dtype_code, p.op_code, p.divisor)
        stats.count(p.counter, moved, moved)
        return
    exchange_digest(topo, "allreduce", p.fields, p.digest, _NO_DATA, _NO_DATA, 0, _UINT8, 0, 1)
    sent0, received0 = stats.snapshot()
    flat = send.reshape(-1)
    recv = flat if recv is send else recv.reshape(-1)  # the algorithms test `is`
    algorithms.allreduce(p.algo, topo, flat, recv, p.op, p.dtype)
    if p.divisor > 1:
        kernels.divide(recv, p.dtype, p.divisor)
    sent1, received1 = stats.snapshot()
    stats.count(p.counter, sent1 - sent0, received1 - received0, counted=True)


def allreduce(x: Any, op: Any, algorithm: str, compression: Any, inplace: bool) -> Any:
    """The result of the call, or None when the fast path does not apply (the caller then
    takes the general path, which gives the same result)."""
    if compression is not None and compression is not Compression.none or type(op) is not ReduceOp:
        return None
    tensor = None
    if type(x) is np.ndarray:
        arr = x
    elif torch is not None and type(x) is torch.Tensor and x.device.type == "cpu":
        if x.requires_grad and inplace or x.dtype == torch.bfloat16:
            return None
        tensor, arr = x, x.detach().numpy()
    else:
        return None
    topo = topology.get()
    plans = _plans[op]
    key = (arr.dtype, arr.shape, algorithm)
    p = plans.get(key, False)
    if p is False or p is not None and p.topo is not topo:
        if algorithm not in algorithms.ALGORITHMS:
            return None  # the general path raises the argument error
        dtype = numpy_dtype_name(arr.dtype) if tensor is None else torch_dtype_name(x.dtype)
        p = plans[key] = None if dtype is None else plan(
            dtype, arr.shape, arr.nbytes, op, algorithm, Compression.none.name, topo)
    if p is None:
        return None
    if p.small is not None:
        out = p.small(arr, inplace)
        if out is None or tensor is None:
            return out
        return tensor if inplace else torch.from_numpy(out)
    if not arr.flags.c_contiguous or inplace and not arr.flags.writeable:
        return None
    if not ENGINE.enter_inline():
        return None
    try:
        out = arr if inplace else np.empty(arr.shape, arr.dtype)
        run(p, topo, arr, out)
    finally:
        topo.watchdog.record.leave()
        ENGINE.leave_inline()
    if tensor is None:
        return out
    return tensor if inplace else torch.from_numpy(out)
