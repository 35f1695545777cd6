"""What every public collective shares: running or submitting a described call, the
argument checks common to several collectives, results in the caller's type, and the
handles of async calls."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from collectives import algorithms
from collectives.api import calls
from collectives.dtypes import CODES, FLOATING
from collectives.ops import ReduceOp, check_op
from collectives.runtime import topology
from collectives.runtime.buffers import Buffer, host_float, store_float
from collectives.runtime.engine import Handle

_INT64 = CODES["int64"]


ALGORITHMS = algorithms.ALGORITHMS


def refuse(collective: str, error: Exception, comm: Any = None) -> NoReturn:
    """Make the next call over comm a `collective` that failed its argument checks here
    with error (TypeError / ValueError): it takes part in the agreement like any call, so
    this rank raises error and the ranks making the real call raise MismatchError naming
    it, instead of waiting for this one. For callers that check arguments of their own
    before calling a collective (the torch.distributed backend)."""
    with calls.Prepared(topology.of(comm), collective, None) as p:
        raise error
    p.run()
    raise error  # not reached: the call raises


def check_algorithm(algorithm: object, known: tuple[str, ...] = ALGORITHMS) -> str:
    if algorithm not in known:
        raise ValueError(f"algorithm: expected one of {list(known)}, got {algorithm!r}")
    return algorithm


def row_elems(shape: tuple) -> int:
    return math.prod(shape[1:])


def need_dim0(buf: Buffer, name: str) -> None:
    if len(buf.shape) == 0:
        raise ValueError(f"{name}: needs at least one dimension (rows on dim 0), got a scalar")


def check_root(root_rank: object, topo: topology.Topology, ranks: list[int] | None) -> int:
    """root_rank as a rank of topo's communicator; ranks: a process set's job ranks, of
    which root_rank is one (None: root_rank is already a rank of the communicator)."""
    if ranks is not None:
        if root_rank not in ranks:
            raise ValueError(f"root_rank: expected one of the process set's ranks {ranks}, "
                             f"got {root_rank!r}")
        return ranks.index(root_rank)
    n = topo.size
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= int(root_rank) < n:
        raise ValueError(f"root_rank: expected an int in [0, {n}), got {root_rank!r}")
    return int(root_rank)


def check_list(tensors: Any) -> None:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors: expected a list or tuple of arrays, got "
                        f"{type(tensors).__name__}")


def check_factor(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    return float(value)


def scale_factors(prescale_factor: object, postscale_factor: object) -> tuple[tuple, float, float]:
    """The agreed fields of a reduction's scale factors (none at 1.0) and the factors."""
    pre = check_factor("prescale_factor", prescale_factor)
    post = check_factor("postscale_factor", postscale_factor)
    fields = ((("prescale_factor", pre),) if pre != 1 else ()) + \
        ((("postscale_factor", post),) if post != 1 else ())
    return fields, pre, post


def scale(src: np.ndarray, dst: np.ndarray, dtype: str, factor: float) -> None:
    """dst = src * factor, one pass (dst may be src), as Horovod scales: in the dtype for
    float32 and float64, in float32 for the half types, in float64 for integers (the
    product truncated toward zero)."""
    if dtype in ("float32", "float64"):
        np.multiply(src, src.dtype.type(factor), out=dst)
    elif dtype in FLOATING:
        store_float(dst, dtype, host_float(src, dtype).astype(np.float32) * np.float32(factor))
    else:
        dst[...] = (src * factor).astype(dst.dtype)


def compressed_into(out: Buffer, buf: Buffer, pre: float, post: float,
                    run: Callable[[np.ndarray], np.ndarray]) -> None:
    """out = run(buf's values scaled by pre) scaled by post: a compressor's collective
    (run) takes and returns host float arrays (bfloat16 widened to float32), and out keeps
    its dtype (rounded to nearest even)."""
    values = host_float(buf.flat, buf.dtype)
    if pre != 1:
        values = values * values.dtype.type(pre)
    result = run(values)
    if post != 1:
        result *= result.dtype.type(post)
    store_float(out.flat, out.dtype, result)


def one_dtype(bufs: list[Buffer]) -> str:
    """The dtype every buffer of a group shares (float32 for an empty group)."""
    dtypes = sorted({b.dtype for b in bufs})
    if len(dtypes) > 1:
        raise TypeError(f"tensors: one dtype per group, got {dtypes}")
    return dtypes[0] if dtypes else "float32"


# ------------------------------------------------------------------------------- handles

def synchronize(handle: Handle) -> Any:
    """Wait for an async collective and return its result (or raise its error)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"handle: expected a Handle from an *_async call, got {type(handle).__name__}")
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True once the async collective has finished; never blocks."""
    if not isinstance(handle, Handle):
        raise TypeError(f"handle: expected a Handle from an *_async call, got {type(handle).__name__}")
    return handle.done()


def check_reduction(op: Any, algorithm: Any, prescale_factor: Any,
                    postscale_factor: Any) -> tuple[ReduceOp, tuple, float, float]:
    """A reduction's checked op, and its scaling (agreed fields, pre and post factors);
    algorithm checked too."""
    op = check_op(op)
    check_algorithm(algorithm)
    return (op, *scale_factors(prescale_factor, postscale_factor))
