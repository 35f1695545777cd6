"""The public collectives. Each one checks its arguments and wraps the caller's buffers
(in the caller's thread), describes the call (calls.py) and hands the engine a Job: the
agreement's payload and the data movement to run once every rank is known to make the
same call. The engine (engine.py) runs it in submission order, sync or async. Every call
takes `comm`: an mpi4py communicator to run over (default: the job's, from init)."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import numpy as np

from . import algorithms, calls, kernels, online, process_sets, topology
from .agreement import PIGGYBACK_BYTES
from .buffers import POOL_MIN_BYTES, Buffer, host_empty, host_float, store_float, wrap
from .calls import Call
from .compression import Compression, check_compression
from .dtypes import CODES, FLOATING, STORAGE, numpy_dtype_name, torch_dtype_name
from .engine import ENGINE, Handle, Job
from .ops import ReduceOp, check_op, kernel_op

try:
    import torch
    _Tensor = torch.Tensor
except ImportError:
    torch = _Tensor = None

ALGORITHMS = algorithms.ALGORITHMS

_INT64 = CODES["int64"]


def _run(topo: topology.Topology, name: str | None, collective: str,
         prepare: Callable[..., tuple[Call, Job]], *args: Any) -> Any:
    return ENGINE.run(topo, *calls.prepare(topo, name, collective, prepare, args))


def _submit(topo: topology.Topology, name: str | None, collective: str,
            prepare: Callable[..., tuple[Call, Job]], *args: Any) -> Handle:
    return calls.submit(topo, name, collective, prepare, args)


def _raise(topo: topology.Topology, error: Exception) -> NoReturn:
    raise error


def refuse(collective: str, error: Exception, comm: Any = None) -> NoReturn:
    """Make the next call over comm a `collective` that failed its argument checks here
    with error (TypeError / ValueError): it takes part in the agreement like any call, so
    this rank raises error and the ranks making the real call raise MismatchError naming
    it, instead of waiting for this one. For callers that check arguments of their own
    before calling a collective (the torch.distributed backend)."""
    _run(topology.of(comm), None, collective, _raise, error)
    raise error  # not reached: the call raises


def _check_algorithm(algorithm: object, known: tuple[str, ...] = ALGORITHMS) -> str:
    if algorithm not in known:
        raise ValueError(f"algorithm: expected one of {list(known)}, got {algorithm!r}")
    return algorithm


def _rows_split(rows: int, n: int) -> list[int]:
    """Rows per rank under Horovod's rule: the first rows % n ranks get one extra."""
    base, extra = divmod(rows, n)
    return [base + (1 if r < extra else 0) for r in range(n)]


def _row_elems(shape: tuple) -> int:
    return math.prod(shape[1:])


def _need_dim0(buf: Buffer, name: str) -> None:
    if len(buf.shape) == 0:
        raise ValueError(f"{name}: needs at least one dimension (rows on dim 0), got a scalar")


def _check_root(root_rank: object, topo: topology.Topology, ranks: list[int] | None) -> int:
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


def _finish(buf: Buffer, out: Buffer) -> Any:
    """The caller's result: x itself for in-place calls (out is buf), else out."""
    if out is buf:
        buf.write_back()
        return buf.orig
    return out.result()


# ----------------------------------------------------------------------------- allreduce

def _fast(topo: topology.Topology, x: Any, op: Any, algorithm: Any, inplace: bool) -> Any:
    """The allreduce fast entry: a host NumPy array or CPU torch tensor whose call was
    described before and has a C++ path (calls.Call.fast) goes straight to it. None: not
    taken."""
    if type(op) is not ReduceOp:
        return None
    if type(x) is np.ndarray:
        call = topo.fast.get((op, x.dtype, x.shape, algorithm))
        if call is None:
            return None
        # a large result's memory comes from the result pool (no fresh pages to fault in)
        out = x if inplace else None if x.nbytes < POOL_MIN_BYTES else host_empty(x.shape,
                                                                                  x.dtype)
        return call.fast(x, out)
    # a tensor goes in by address: its dtype and shape are the described call's, so only
    # where it lives and its layout are left to check
    if type(x) is not _Tensor or not x.is_cpu or x.requires_grad and inplace \
            or not x.is_contiguous():
        return None
    call = topo.fast.get((op, x.dtype, x.shape, algorithm))
    if call is None:
        return None
    if inplace:
        out = x
    elif x.numel() * x.element_size() < POOL_MIN_BYTES:
        out = torch.empty_like(x, requires_grad=False)
    else:
        out = torch.from_numpy(host_empty(x.shape, STORAGE[torch_dtype_name(x.dtype)]))
    return out if call.fast.at(x.data_ptr(), out.data_ptr()) else None


def _check_factor(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    return float(value)


def _scaling(prescale_factor: object, postscale_factor: object) -> tuple[tuple, float, float]:
    """The agreed fields of a reduction's scale factors (none at 1.0) and the factors."""
    pre = _check_factor("prescale_factor", prescale_factor)
    post = _check_factor("postscale_factor", postscale_factor)
    fields = ((("prescale_factor", pre),) if pre != 1 else ()) + \
        ((("postscale_factor", post),) if post != 1 else ())
    return fields, pre, post


def _scale(src: np.ndarray, dst: np.ndarray, dtype: str, factor: float) -> None:
    """dst = src * factor, one pass (dst may be src), as Horovod scales: in the dtype for
    float32 and float64, in float32 for the half types, in float64 for integers (the
    product truncated toward zero)."""
    if dtype in ("float32", "float64"):
        np.multiply(src, src.dtype.type(factor), out=dst)
    elif dtype in FLOATING:
        store_float(dst, dtype, host_float(src, dtype).astype(np.float32) * np.float32(factor))
    else:
        dst[...] = (src * factor).astype(dst.dtype)


def _allreduce(topo: topology.Topology, x: Any, op: Any, algorithm: Any, compression: Any,
               inplace: bool, prescale_factor: Any = 1.0,
               postscale_factor: Any = 1.0) -> tuple[Call, Job]:
    op = check_op(op)
    _check_algorithm(algorithm)
    compressor = check_compression(compression)
    buf = wrap(x, "x")  # type check now, in the caller's thread
    if prescale_factor != 1 or postscale_factor != 1:
        return _scaled(topo, buf, op, algorithm, compressor, inplace, prescale_factor,
                       postscale_factor)
    if compressor is not Compression.none and buf.dtype in FLOATING:
        return _compressed(topo, buf, op, algorithm, compressor, inplace)
    call = calls.allreduce(topo, buf.dtype, buf.shape, buf.nbytes, op, algorithm)
    out = buf if inplace else buf.empty(buf.shape)
    fast = call.fast is not None and not buf.staged and buf.dtype != "bfloat16"
    key = (op, x.dtype, x.shape, algorithm)
    checked = algorithm == "auto" and online.checks(topo, buf.nbytes)
    if fast and not checked:
        topo.fast[key] = call  # the next such call takes the fast entry
    if call.rides:  # the data rides in the agreement
        return call, Job(lambda: _finish(buf, out), buf.flat, out.flat, buf.flat.size,
                         call.dtype_code, call.op_code, call.divisor)

    def reduce(algo: str) -> None:
        algorithms.reduce(algo, topo, buf.flat, out.flat, op, buf.dtype)

    def move() -> Any:
        if checked:  # `auto` picks the algorithm now (online.py)
            online.run(topo, buf.nbytes, reduce)
            if fast and online.settled_on(topo, buf.nbytes, call.algorithm, call.fast):
                topo.fast[key] = call  # the choice is final: the next such call is fast
        else:
            reduce(call.algorithm)
        return _finish(buf, out)

    return call, Job(move)


def _scaled(topo: topology.Topology, buf: Buffer, op: ReduceOp, algorithm: str,
            compressor: Any, inplace: bool, prescale_factor: Any,
            postscale_factor: Any) -> tuple[Call, Job]:
    """An allreduce with scale factors: agreed like its other fields; x scaled on the way
    into the result buffer (no separate copy), the result scaled after the reduction."""
    scaling, pre, post = _scaling(prescale_factor, postscale_factor)
    if compressor is not Compression.none and buf.dtype in FLOATING:
        return _compressed(topo, buf, op, algorithm, compressor, inplace, scaling, pre, post)
    fields = (("op", op.name), ("dtype", buf.dtype), ("shape", buf.shape),
              ("algorithm", algorithm), ("compression", "none")) + scaling
    algo = calls.concrete(topo, "allreduce", algorithm, buf.nbytes)
    call = calls.reduction(topo, "allreduce", fields, buf.dtype, buf.nbytes, op, algo)
    out = buf if inplace else buf.empty(buf.shape)
    if pre != 1:
        _scale(buf.flat, out.flat, buf.dtype, pre)
    send = out.flat if pre != 1 else buf.flat

    def finish() -> Any:
        if post != 1:
            _scale(out.flat, out.flat, out.dtype, post)
        return _finish(buf, out)

    if call.rides:
        return call, Job(finish, send, out.flat, buf.flat.size, call.dtype_code, call.op_code,
                         call.divisor)

    def move() -> Any:
        algorithms.reduce(call.algorithm, topo, send, out.flat, op, buf.dtype)
        return finish()

    return call, Job(move)


def _compressed(topo: topology.Topology, buf: Buffer, op: ReduceOp, algorithm: str,
                compressor: Any, inplace: bool, scaling: tuple = (), pre: float = 1.0,
                post: float = 1.0) -> tuple[Call, Job]:
    """A floating allreduce under a compressor (compression.py), counted under its name."""
    compressor.check_op(op)
    fields = (("op", op.name), ("dtype", buf.dtype), ("shape", buf.shape),
              ("algorithm", algorithm), ("compression", compressor.name)) + scaling
    call = calls.describe(topo, "allreduce", fields, compressor.name)
    out = buf if inplace else buf.empty(buf.shape)

    def move() -> Any:
        values = host_float(buf.flat, buf.dtype)
        if pre != 1:
            values = values * values.dtype.type(pre)
        reduced = compressor.allreduce(topo, values, op, algorithm)
        if post != 1:
            reduced *= reduced.dtype.type(post)
        store_float(out.flat, out.dtype, reduced)
        return _finish(buf, out)

    return call, Job(move)


def allreduce(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
              compression: Any = None, *, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None, comm: Any = None,
              process_set: Any = None) -> Any:
    """Reduce x over all ranks; a new array of x's type, dtype, shape and device.
    prescale_factor multiplies every rank's x before the reduction, postscale_factor the
    result (as Horovod's); name labels the call in mismatch and stall messages and the
    timeline (every rank must pass the same)."""
    # inline: the allreduce fast entry's path
    topo = topology.of(comm) if process_set is None else process_sets.resolve(comm, process_set)
    if compression is None and name is None and prescale_factor == 1 and postscale_factor == 1:
        out = _fast(topo, x, op, algorithm, False)
        if out is not None:
            return out
    return _run(topo, name, "allreduce", _allreduce, x, op, algorithm, compression, False,
                prescale_factor, postscale_factor)


def allreduce_(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
               compression: Any = None, *, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, name: str | None = None, comm: Any = None,
               process_set: Any = None) -> Any:
    """Reduce x over all ranks in place; returns x."""
    # inline: the allreduce fast entry's path
    topo = topology.of(comm) if process_set is None else process_sets.resolve(comm, process_set)
    if compression is None and name is None and prescale_factor == 1 and postscale_factor == 1 \
            and _fast(topo, x, op, algorithm, True) is not None:
        return x
    return _run(topo, name, "allreduce", _allreduce, x, op, algorithm, compression, True,
                prescale_factor, postscale_factor)


def allreduce_async(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
                    compression: Any = None, *, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, name: str | None = None,
                    comm: Any = None, process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    return _submit(topo, name, "allreduce", _allreduce, x, op, algorithm, compression, False,
                   prescale_factor, postscale_factor)


def allreduce_async_(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
                     compression: Any = None, *, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, name: str | None = None,
                     comm: Any = None, process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    return _submit(topo, name, "allreduce", _allreduce, x, op, algorithm, compression, True,
                   prescale_factor, postscale_factor)


# --------------------------------------------------------------------- grouped allreduce

def _packable(flat: np.ndarray) -> np.ndarray:
    """A flat storage array as kernels.pack takes it: bfloat16's uint16 bits viewed as
    float16 (pack copies bits exactly at scale 1)."""
    return flat.view(np.float16) if flat.dtype == np.uint16 else flat


class _Group(NamedTuple):
    """A group of tensors packed into one flat storage array, and how to hand a reduced
    one back (as new tensors, or into the originals)."""

    dtype: str
    shapes: tuple
    packed: np.ndarray
    finish: Callable[[np.ndarray], list]


def _host_group(tensors: list, inplace: bool) -> _Group | None:
    """The group straight through the C++ pack and unpack (a fraction of a microsecond per
    tensor): contiguous host NumPy arrays, or contiguous CPU torch tensors. None otherwise."""
    first = tensors[0]
    if all(type(t) is np.ndarray and t.flags.c_contiguous for t in tensors):
        dtype, like = numpy_dtype_name(first.dtype), np.empty_like
    elif torch is not None and all(type(t) is _Tensor and t.device.type == "cpu"
                                   and t.is_contiguous() for t in tensors):
        dtype, like = torch_dtype_name(first.dtype), torch.empty_like
    else:
        return None
    if dtype is None:
        return None  # wrap() names the unsupported dtype
    packed = wrap(kernels.pack(tensors), "tensors").flat  # checks every tensor's dtype
    outs = tensors if inplace else [like(t) for t in tensors]

    def finish(reduced: np.ndarray) -> list:
        buffer = reduced if like is np.empty_like else torch.from_numpy(_packable(reduced))
        kernels.unpack(buffer.view(torch.bfloat16) if dtype == "bfloat16" else buffer, outs)
        return list(outs)

    return _Group(dtype, tuple(tuple(t.shape) for t in tensors), packed, finish)


def _wrapped_group(tensors: list, inplace: bool) -> _Group:
    """The group through wrap(): any array type, staged where needed."""
    bufs = [wrap(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    dtype = _one_dtype(bufs)
    packed = kernels.pack([_packable(b.flat) for b in bufs]) if bufs else np.empty(0)
    outs = bufs if inplace else [b.empty(b.shape) for b in bufs]

    def finish(reduced: np.ndarray) -> list:
        if outs:
            kernels.unpack(_packable(reduced), [_packable(o.flat) for o in outs])
        return [_finish(b, o) for b, o in zip(bufs, outs)]

    return _Group(dtype, tuple(b.shape for b in bufs), packed.view(STORAGE[dtype]), finish)


def _grouped_allreduce(topo: topology.Topology, tensors: Any, op: Any, algorithm: Any,
                       compression: Any, inplace: bool, prescale_factor: Any = 1.0,
                       postscale_factor: Any = 1.0) -> tuple[Call, Job]:
    op = check_op(op)
    _check_algorithm(algorithm)
    compressor = check_compression(compression)
    scaling, pre, post = _scaling(prescale_factor, postscale_factor)
    _check_list(tensors)
    group = tensors and _host_group(tensors, inplace) or _wrapped_group(tensors, inplace)
    dtype, packed = group.dtype, group.packed
    compressed = compressor is not Compression.none and dtype in FLOATING
    fields = (("op", op.name), ("dtype", dtype), ("shapes", group.shapes),
              ("algorithm", algorithm), ("compression", compressor.name)) + scaling
    if compressed:
        call = calls.describe(topo, "grouped_allreduce", fields, compressor.name)
    else:
        algo = calls.concrete(topo, "allreduce", algorithm, packed.nbytes)
        call = calls.reduction(topo, "grouped_allreduce", fields, dtype, packed.nbytes, op, algo)
    if pre != 1:  # packed is our own copy
        _scale(packed, packed, dtype, pre)

    def finish(reduced: np.ndarray) -> list:
        if post != 1:
            _scale(reduced, reduced, dtype, post)
        return group.finish(reduced)

    if call.rides:
        return call, Job(lambda: finish(packed), packed, packed, packed.size,
                         call.dtype_code, call.op_code, call.divisor)

    def move() -> list:
        if compressed:
            reduced = np.empty_like(packed)
            store_float(reduced, dtype,
                        compressor.allreduce(topo, host_float(packed, dtype), op, algorithm))
        else:
            reduced = packed
            algorithms.reduce(call.algorithm, topo, packed, reduced, op, dtype)
        return finish(reduced)

    return call, Job(move)


def _check_list(tensors: Any) -> None:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors: expected a list or tuple of arrays, got "
                        f"{type(tensors).__name__}")


def grouped_allreduce(tensors: list, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
                      compression: Any = None, *, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: str | None = None,
                      comm: Any = None, process_set: Any = None) -> list:
    """allreduce of every tensor of the list in one call: one agreement and one fused
    message (the tensors packed by one C++ call). The tensors share one dtype and may differ
    in shape and type; returns a list of new arrays like them."""
    topo = process_sets.resolve(comm, process_set)
    return _run(topo, name, "grouped_allreduce", _grouped_allreduce, tensors, op, algorithm,
                compression, False, prescale_factor, postscale_factor)


def grouped_allreduce_(tensors: list, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
                       compression: Any = None, *, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, name: str | None = None,
                       comm: Any = None, process_set: Any = None) -> list:
    """grouped_allreduce in place; returns the tensors."""
    topo = process_sets.resolve(comm, process_set)
    return _run(topo, name, "grouped_allreduce", _grouped_allreduce, tensors, op, algorithm,
                compression, True, prescale_factor, postscale_factor)


def grouped_allreduce_async(tensors: list, op: ReduceOp = ReduceOp.Average,
                            algorithm: str = "auto", compression: Any = None, *,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            name: str | None = None, comm: Any = None,
                            process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    return _submit(topo, name, "grouped_allreduce", _grouped_allreduce, tensors, op, algorithm,
                   compression, False, prescale_factor, postscale_factor)


def grouped_allreduce_async_(tensors: list, op: ReduceOp = ReduceOp.Average,
                             algorithm: str = "auto", compression: Any = None, *,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             name: str | None = None, comm: Any = None,
                             process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    return _submit(topo, name, "grouped_allreduce", _grouped_allreduce, tensors, op, algorithm,
                   compression, True, prescale_factor, postscale_factor)


# ----------------------------------------------------------------------------- allgather

class _FromEveryRank:
    """k ints from every rank (row counts, sizes, splits), in rank order: gathered by the
    agreement exchange's Sum, each rank filling its own row of a zero table, when the table
    fits in it (PIGGYBACK_BYTES); else by a plain allgather in the call's move."""

    __slots__ = ("table", "mine", "topo", "carried")

    def __init__(self, topo: topology.Topology, mine: list[int]):
        k = len(mine)
        self.table = np.zeros(topo.size * k, np.int64)
        self.table[topo.rank * k:(topo.rank + 1) * k] = mine
        self.mine, self.topo = mine, topo
        self.carried = self.table.nbytes <= PIGGYBACK_BYTES

    def values(self) -> np.ndarray:
        """(ranks, k) int64: every rank's ints (in the move, after the agreement)."""
        gathered = self.table if self.carried else \
            np.array(self.topo.comm.allgather(self.mine), np.int64)
        return gathered.reshape(self.topo.size, len(self.mine))

    def job(self, move: Callable[[], Any]) -> Job:
        """The call's Job: move, with the table riding in the agreement when it fits."""
        if not self.carried:
            return Job(move)
        return Job(move, self.table, self.table, self.table.size, _INT64, int(ReduceOp.Sum), 1)


def _allgather(topo: topology.Topology, x: Any, algorithm: Any) -> tuple[Call, Job]:
    _check_algorithm(algorithm)
    buf = wrap(x, "x")
    _need_dim0(buf, "x")
    fields = (("dtype", buf.dtype), ("row_shape", buf.shape[1:]), ("algorithm", algorithm))
    call = calls.describe(topo, "allgather", fields, algorithm)
    rows = _FromEveryRank(topo, [buf.shape[0]])  # every rank's dim 0

    def move() -> Any:
        everyone = rows.values()[:, 0].tolist()
        elems = _row_elems(buf.shape)
        counts = [r * elems for r in everyone]
        out = buf.empty((sum(everyone),) + buf.shape[1:])
        algo = calls.concrete(topo, "allgather", algorithm, out.nbytes)
        ENGINE.native.credit(topo.stats, "allgather", algo)  # `auto` chose by the total size
        algorithms.allgather(algo, topo, buf.flat, out.flat, counts)
        return out.result()

    return call, rows.job(move)


def allgather(x: Any, algorithm: str = "auto", *, name: str | None = None,
              comm: Any = None, process_set: Any = None) -> Any:
    """Every rank's x concatenated on dim 0 in rank order (dim 0 may differ per rank)."""
    topo = process_sets.resolve(comm, process_set)
    return _run(topo, name, "allgather", _allgather, x, algorithm)


def allgather_async(x: Any, algorithm: str = "auto", *, name: str | None = None,
                    comm: Any = None, process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    return _submit(topo, name, "allgather", _allgather, x, algorithm)


def _one_dtype(bufs: list[Buffer]) -> str:
    """The dtype every buffer of a group shares (float32 for an empty group)."""
    dtypes = sorted({b.dtype for b in bufs})
    if len(dtypes) > 1:
        raise TypeError(f"tensors: one dtype per group, got {dtypes}")
    return dtypes[0] if dtypes else "float32"


def _grouped_allgather(topo: topology.Topology, tensors: Any,
                       algorithm: Any) -> tuple[Call, Job]:
    _check_algorithm(algorithm)
    _check_list(tensors)
    bufs = [wrap(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    for i, b in enumerate(bufs):
        _need_dim0(b, f"tensors[{i}]")
    dtype = _one_dtype(bufs)
    n, k = topo.size, len(bufs)
    fields = (("dtype", dtype), ("row_shapes", tuple(b.shape[1:] for b in bufs)),
              ("algorithm", algorithm))
    call = calls.describe(topo, "grouped_allgather", fields, algorithm)
    rows = _FromEveryRank(topo, [b.shape[0] for b in bufs])  # each tensor's dim 0

    def move() -> list:
        everyone = rows.values()  # [q, i]: rank q's dim 0 of tensor i
        elems = np.array([_row_elems(b.shape) for b in bufs], np.int64)
        sizes = everyone * elems  # elements of tensor i from rank q
        send = np.concatenate([b.flat for b in bufs]) if bufs else np.empty(0, STORAGE[dtype])
        recv = np.empty(int(sizes.sum()), STORAGE[dtype])
        algo = calls.concrete(topo, "allgather", algorithm, recv.nbytes)
        ENGINE.native.credit(topo.stats, "grouped_allgather", algo)
        algorithms.allgather(algo, topo, send, recv, sizes.sum(axis=1).tolist())
        starts = np.concatenate([[0], np.cumsum(sizes.reshape(-1))])  # rank-major order
        outs = []
        for i, b in enumerate(bufs):
            out = b.empty((int(everyone[:, i].sum()),) + b.shape[1:])
            pieces = [recv[starts[q * k + i]:starts[q * k + i + 1]] for q in range(n)]
            np.concatenate(pieces, out=out.flat)
            outs.append(out.result())
        return outs

    return call, rows.job(move)


def grouped_allgather(tensors: list, algorithm: str = "auto", *, name: str | None = None,
                      comm: Any = None, process_set: Any = None) -> list:
    """allgather of every tensor of the list in one call: one agreement (carrying every
    tensor's dim 0 from every rank) and one fused message. One dtype per group."""
    topo = process_sets.resolve(comm, process_set)
    return _run(topo, name, "grouped_allgather", _grouped_allgather, tensors, algorithm)


def grouped_allgather_async(tensors: list, algorithm: str = "auto", *, name: str | None = None,
                            comm: Any = None, process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    return _submit(topo, name, "grouped_allgather", _grouped_allgather, tensors, algorithm)


# ------------------------------------------------------------------------- reducescatter

def _reducescatter(topo: topology.Topology, x: Any, op: Any, algorithm: Any,
                   prescale_factor: Any = 1.0, postscale_factor: Any = 1.0
                   ) -> tuple[Call, Job]:
    op = check_op(op)
    _check_algorithm(algorithm)
    scaling, pre, post = _scaling(prescale_factor, postscale_factor)
    buf = wrap(x, "x")
    _need_dim0(buf, "x")
    fields = (("op", op.name), ("dtype", buf.dtype), ("shape", buf.shape),
              ("algorithm", algorithm)) + scaling
    call = calls.describe(topo, "reducescatter", fields,
                          calls.concrete(topo, "reducescatter", algorithm, buf.nbytes))
    send = buf.flat
    if pre != 1:  # a scaled copy: x is the caller's
        send = np.empty_like(buf.flat)
        _scale(buf.flat, send, buf.dtype, pre)

    def move() -> Any:
        rows = _rows_split(buf.shape[0], topo.size)
        elems = _row_elems(buf.shape)
        out = buf.empty((rows[topo.rank],) + buf.shape[1:])
        algorithms.reducescatter(call.algorithm, topo, send, out.flat,
                                 [r * elems for r in rows], kernel_op(op), buf.dtype)
        algorithms.average(out.flat, buf.dtype, op, topo.size)
        if post != 1:
            _scale(out.flat, out.flat, buf.dtype, post)
        return out.result()

    return call, Job(move)


def reducescatter(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto", *,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  name: str | None = None, comm: Any = None, process_set: Any = None) -> Any:
    """This rank's rows of the reduction of x over all ranks (Horovod's row split)."""
    topo = process_sets.resolve(comm, process_set)
    return _run(topo, name, "reducescatter", _reducescatter, x, op, algorithm, prescale_factor,
                postscale_factor)


def reducescatter_async(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto", *,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        name: str | None = None, comm: Any = None,
                        process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    return _submit(topo, name, "reducescatter", _reducescatter, x, op, algorithm, prescale_factor,
                   postscale_factor)


def _grouped_reducescatter(topo: topology.Topology, tensors: Any, op: Any, algorithm: Any,
                           prescale_factor: Any = 1.0, postscale_factor: Any = 1.0
                           ) -> tuple[Call, Job]:
    op = check_op(op)
    _check_algorithm(algorithm)
    scaling, pre, post = _scaling(prescale_factor, postscale_factor)
    _check_list(tensors)
    bufs = [wrap(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    for i, b in enumerate(bufs):
        _need_dim0(b, f"tensors[{i}]")
    dtype = _one_dtype(bufs)
    nbytes = sum(b.nbytes for b in bufs)
    fields = (("op", op.name), ("dtype", dtype), ("shapes", tuple(b.shape for b in bufs)),
              ("algorithm", algorithm)) + scaling
    call = calls.describe(topo, "grouped_reducescatter", fields,
                          calls.concrete(topo, "reducescatter", algorithm, nbytes))
    n, r = topo.size, topo.rank
    rows = [_rows_split(b.shape[0], n) for b in bufs]
    elems = [_row_elems(b.shape) for b in bufs]
    # the send buffer ordered by destination: rank j's rows of every tensor, then j + 1's
    pieces = []
    for j in range(n):
        for b, split, e in zip(bufs, rows, elems):
            start = sum(split[:j]) * e
            pieces.append(b.flat[start:start + split[j] * e])
    send = np.concatenate(pieces) if pieces else np.empty(0, STORAGE[dtype])
    if pre != 1:
        _scale(send, send, dtype, pre)
    counts = [sum(split[j] * e for split, e in zip(rows, elems)) for j in range(n)]

    def move() -> list:
        recv = np.empty(counts[r], STORAGE[dtype])
        algorithms.reducescatter(call.algorithm, topo, send, recv, counts, kernel_op(op),
                                 dtype)
        algorithms.average(recv, dtype, op, n)
        if post != 1:
            _scale(recv, recv, dtype, post)
        outs, at = [], 0
        for b, split, e in zip(bufs, rows, elems):
            out = b.empty((split[r],) + b.shape[1:])
            out.flat[...] = recv[at:at + split[r] * e]
            at += split[r] * e
            outs.append(out.result())
        return outs

    return call, Job(move)


def grouped_reducescatter(tensors: list, op: ReduceOp = ReduceOp.Average,
                          algorithm: str = "auto", *, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, name: str | None = None,
                          comm: Any = None, process_set: Any = None) -> list:
    """reducescatter of every tensor of the list in one call: one agreement and one fused
    reducescatter (each tensor split by Horovod's row rule). One dtype per group."""
    topo = process_sets.resolve(comm, process_set)
    return _run(topo, name, "grouped_reducescatter", _grouped_reducescatter, tensors, op, algorithm,
                prescale_factor, postscale_factor)


def grouped_reducescatter_async(tensors: list, op: ReduceOp = ReduceOp.Average,
                                algorithm: str = "auto", *, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0, name: str | None = None,
                                comm: Any = None, process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    return _submit(topo, name, "grouped_reducescatter", _grouped_reducescatter, tensors, op,
                   algorithm, prescale_factor, postscale_factor)


# ----------------------------------------------------------------------------- broadcast

def _broadcast(topo: topology.Topology, x: Any, root_rank: Any, algorithm: Any,
               inplace: bool, ranks: list[int] | None) -> tuple[Call, Job]:
    _check_algorithm(algorithm)
    root = _check_root(root_rank, topo, ranks)
    buf = wrap(x, "x")
    fields = (("dtype", buf.dtype), ("shape", buf.shape), ("root_rank", root),
              ("algorithm", algorithm))
    call = calls.describe(topo, "broadcast", fields,
                          calls.concrete(topo, "broadcast", algorithm, buf.nbytes))

    def move() -> Any:
        out = buf if inplace else buf.empty(buf.shape)
        if not inplace:
            out.flat[...] = buf.flat
        algorithms.broadcast(call.algorithm, topo, out.flat, root)
        return _finish(buf, out)

    return call, Job(move)


def broadcast(x: Any, root_rank: int = 0, algorithm: str = "auto", *, name: str | None = None,
              comm: Any = None, process_set: Any = None) -> Any:
    """root_rank's x on every rank, as a new array."""
    topo = process_sets.resolve(comm, process_set)
    return _run(topo, name, "broadcast", _broadcast, x, root_rank, algorithm, False,
                process_sets.job_ranks(process_set))


def broadcast_(x: Any, root_rank: int = 0, algorithm: str = "auto", *, name: str | None = None,
               comm: Any = None, process_set: Any = None) -> Any:
    """Overwrite x with root_rank's x on every rank; returns x."""
    topo = process_sets.resolve(comm, process_set)
    return _run(topo, name, "broadcast", _broadcast, x, root_rank, algorithm, True,
                process_sets.job_ranks(process_set))


def broadcast_async(x: Any, root_rank: int = 0, algorithm: str = "auto", *,
                    name: str | None = None, comm: Any = None,
                    process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    return _submit(topo, name, "broadcast", _broadcast, x, root_rank, algorithm, False,
                process_sets.job_ranks(process_set))


def broadcast_async_(x: Any, root_rank: int = 0, algorithm: str = "auto", *,
                     name: str | None = None, comm: Any = None,
                     process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    return _submit(topo, name, "broadcast", _broadcast, x, root_rank, algorithm, True,
                process_sets.job_ranks(process_set))


def _broadcast_object(topo: topology.Topology, obj: Any, root_rank: Any,
                      ranks: list[int] | None) -> tuple[Call, Job]:
    root = _check_root(root_rank, topo, ranks)
    call = calls.describe(topo, "broadcast_object", (("root_rank", root),), "mpi")

    def move() -> Any:
        payload, error = b"", None
        if topo.rank == root:
            try:
                payload = pickle.dumps(obj)
            except Exception as exc:  # every rank must learn of it, not only the root
                error = exc
        size = topo.comm.bcast(-1 if error else len(payload), root=root)
        if size < 0:
            raise ValueError(f"obj: root_rank {root}'s object cannot be pickled") from error
        data = np.frombuffer(payload, np.uint8).copy() if payload else np.empty(size, np.uint8)
        algorithms.broadcast("mpi", topo, data, root)
        return obj if topo.rank == root else pickle.loads(data.tobytes())

    return call, Job(move)


def broadcast_object(obj: Any, root_rank: int = 0, *, name: str | None = None,
                     comm: Any = None, process_set: Any = None) -> Any:
    """root_rank's picklable obj on every rank."""
    topo = process_sets.resolve(comm, process_set)
    return _run(topo, name, "broadcast_object", _broadcast_object, obj, root_rank,
                process_sets.job_ranks(process_set))


def _allgather_object(topo: topology.Topology, obj: Any) -> tuple[Call, Job]:
    try:
        payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    except Exception as exc:  # any pickling failure: reported on every rank
        raise ValueError(f"obj: cannot be pickled ({type(exc).__name__}: {exc})") from exc
    n = topo.size
    call = calls.describe(topo, "allgather_object", (), "auto")
    sizes = _FromEveryRank(topo, [payload.size])  # every rank's pickle size

    def move() -> list:
        everyone = sizes.values()[:, 0]
        recv = np.empty(int(everyone.sum()), np.uint8)
        algo = calls.concrete(topo, "allgather", "auto", recv.nbytes)
        ENGINE.native.credit(topo.stats, "allgather_object", algo)
        algorithms.allgather(algo, topo, payload, recv, everyone.tolist())
        starts = np.concatenate([[0], np.cumsum(everyone)])
        return [pickle.loads(recv[starts[q]:starts[q + 1]].tobytes()) for q in range(n)]

    return call, sizes.job(move)


def allgather_object(obj: Any, *, name: str | None = None, comm: Any = None,
                     process_set: Any = None) -> list:
    """Every rank's picklable obj, as a list in rank order."""
    topo = process_sets.resolve(comm, process_set)
    return _run(topo, name, "allgather_object", _allgather_object, obj)


# ------------------------------------------------------------------------------ alltoall

def _check_splits(splits: Any, rows: int, n: int) -> list[int]:
    """Rows of x for each rank: splits as a list of n ints >= 0 summing to rows, or an
    even split (rows divisible by n) for None."""
    if splits is None:
        if rows % n:
            raise ValueError(f"x: dim 0 ({rows}) must be divisible by the {n} ranks when "
                             "splits is not given")
        return [rows // n] * n
    try:
        values = splits.tolist() if hasattr(splits, "tolist") else list(splits)
    except TypeError:
        values = None
    ok = isinstance(values, list) and all(type(v) is int for v in values)
    if not ok or len(values) != n or min(values, default=0) < 0 or sum(values) != rows:
        raise ValueError(f"splits: expected {n} ints >= 0 summing to dim 0 of x ({rows}), "
                         f"got {splits!r}")
    return values


def _alltoall(topo: topology.Topology, x: Any, splits: Any,
              algorithm: Any) -> tuple[Call, Job]:
    _check_algorithm(algorithm, algorithms.ALLTOALL_ALGORITHMS)
    buf = wrap(x, "x")
    _need_dim0(buf, "x")
    n, r = topo.size, topo.rank
    mine = _check_splits(splits, buf.shape[0], n)
    fields = (("dtype", buf.dtype), ("row_shape", buf.shape[1:]), ("algorithm", algorithm))
    call = calls.describe(topo, "alltoall", fields, algorithm)
    matrix = _FromEveryRank(topo, mine)  # row j: rank j's splits

    def move() -> Any:
        everyone = matrix.values().tolist()  # Python ints: cheaper than NumPy's at this size
        received = [row[r] for row in everyone]
        elems = _row_elems(buf.shape)
        out = buf.empty((sum(received),) + buf.shape[1:])
        per_rank = sum(map(sum, everyone)) * elems * buf.flat.itemsize // n  # auto: agreed
        algo = calls.concrete(topo, "alltoall", algorithm, per_rank)
        ENGINE.native.credit(topo.stats, "alltoall", algo)
        algorithms.alltoall(algo, topo, buf.flat, out.flat, [c * elems for c in mine],
                            [c * elems for c in received])
        if splits is None:
            return out.result()
        got = np.array(received, np.int32)
        return out.result(), (torch.from_numpy(got) if buf.kind == "torch" else got)

    return call, matrix.job(move)


def alltoall(x: Any, splits: Any = None, algorithm: str = "auto", *, name: str | None = None,
             comm: Any = None, process_set: Any = None) -> Any:
    """Rank r sends rows splits[j] of x's dim 0 (in order) to rank j; splits None: an even
    split. Returns the rows received, in rank order, and, when splits is given, the number
    received from each rank (int32, as Horovod does)."""
    topo = process_sets.resolve(comm, process_set)
    return _run(topo, name, "alltoall", _alltoall, x, splits, algorithm)


def alltoall_async(x: Any, splits: Any = None, algorithm: str = "auto", *,
                   name: str | None = None, comm: Any = None,
                   process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    return _submit(topo, name, "alltoall", _alltoall, x, splits, algorithm)


# ------------------------------------------------------------------------------- barrier

def _barrier(topo: topology.Topology) -> tuple[Call, Job]:
    return calls.describe(topo, "barrier", (), "agreement"), Job(None)


def barrier(*, name: str | None = None,
            comm: Any = None, process_set: Any = None) -> None:
    """Return once every rank has called barrier. It is the agreement exchange itself: a
    recursive doubling in which no rank finishes before hearing, directly or through its
    partners, from every other; so it is checked (a rank in another collective raises
    MismatchError everywhere) and stall-watched like any call, in ceil(log2 n) steps."""
    topo = process_sets.resolve(comm, process_set)
    _run(topo, name, "barrier", _barrier)


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
