"""The small-allreduce fast path: a host NumPy array or CPU torch tensor of at most
agreement.PIGGYBACK_BYTES is reduced by `tree` inside its own agreement exchange, with
none of the general path's staging, and everything derived from the call's arguments
(signature digest, kernel codes, `auto`'s choice) kept per distinct call. Horovod-style code
allreduces many tiny tensors (loss, metrics, counters), so per-call overhead here is what
users feel. Results are the same bits as the general path's `tree` (the same exchange)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import kernels, select, stats, topology
from .agreement import PIGGYBACK_BYTES, digest, exchange_digest
from .buffers import numpy_dtype_name, torch_dtype_name
from .compression import Compression
from .engine import ENGINE
from .ops import ReduceOp, kernel_op

try:
    import torch
except ImportError:
    torch = None


class _Plan(NamedTuple):
    fields: tuple
    digest: int
    dtype_code: int
    op: int
    divisor: int
    counter: list[int]


_plans: dict[tuple, _Plan | None] = {}


def _plan(dtype: str | None, shape: tuple, nbytes: int, op: ReduceOp, algorithm: str,
          topo: topology.Topology) -> _Plan | None:
    if (dtype is None or dtype == "bfloat16" or nbytes > PIGGYBACK_BYTES
            or algorithm == "auto" and select.choose("allreduce", nbytes, topo) != "tree"):
        return None
    fields = (("op", op.name), ("dtype", dtype), ("shape", shape), ("algorithm", algorithm),
              ("compression", Compression.none.name))
    return _Plan(fields, digest(("allreduce", fields)), kernels.DTYPE_CODES[dtype],
                 int(kernel_op(op)), topo.size if op is ReduceOp.Average else 1,
                 stats.counter("allreduce", "tree"))


def allreduce(x: Any, op: Any, algorithm: str, compression: Any, inplace: bool) -> Any:
    """The result of the call, or None when the fast path does not apply (the caller then
    takes the general path, which gives the same result)."""
    if compression is not None and compression is not Compression.none:
        return None
    tensor = None
    if type(x) is np.ndarray:
        arr = x
    elif torch is not None and type(x) is torch.Tensor and x.device.type == "cpu":
        if x.requires_grad and inplace:
            return None
        tensor, arr = x, x.detach().numpy() if x.dtype != torch.bfloat16 else None
        if arr is None:
            return None
    else:
        return None
    topo = topology.get()
    key = (arr.dtype, arr.shape, op, algorithm, id(topo))
    plan = _plans.get(key, False)
    if plan is False:
        if type(op) is not ReduceOp or algorithm not in ("auto", "tree"):
            return None
        plan = _plans[key] = _plan(numpy_dtype_name(arr.dtype) if tensor is None else
                                   torch_dtype_name(x.dtype), arr.shape, arr.nbytes, op,
                                   algorithm, topo)
    if plan is None or not arr.flags.c_contiguous or inplace and not arr.flags.writeable:
        return None
    if not ENGINE.enter_inline():
        return None
    try:
        out = arr if inplace else np.empty_like(arr)
        sent, received = exchange_digest(topo, "allreduce", plan.fields, plan.digest, arr, out,
                                         arr.size, plan.dtype_code, plan.op, plan.divisor)
        stats.count(plan.counter, sent, received)
    finally:
        topo.watchdog.record.leave()
        ENGINE.leave_inline()
    if tensor is None:
        return out
    return tensor if inplace else torch.from_numpy(out)
