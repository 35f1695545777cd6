"""The public collectives: argument checks, agreement, algorithm dispatch, Average and
stats, on any supported array type. Sync calls and *_async calls share one ordered engine."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from . import algorithms, fastpath, kernels, quantized, select, stats, topology
from .agreement import agree, agree_rows
from .buffers import Buffer, store_float32, wrap
from .compression import Compression, check_compression
from .engine import ENGINE, Handle
from .ops import ReduceOp, check_op, kernel_op

ALGORITHMS = algorithms.ALGORITHMS


def _check_algorithm(algorithm: object) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {list(ALGORITHMS)}, got {algorithm!r}")
    return algorithm


def _resolve(algorithm: str, collective: str, nbytes: int) -> str:
    """The concrete algorithm for `auto` (a function of agreed values: the same everywhere)."""
    topo = topology.get()
    if algorithm != "auto":
        algorithms.check(algorithm, topo)
        return algorithm
    return select.choose(collective, nbytes, topo)


def _run(name: str, work: Callable[[], Any]) -> Any:
    return ENGINE.run(name, _tracked(work))


def _submit(name: str, work: Callable[[], Any]) -> Handle:
    return ENGINE.submit(name, _tracked(work))


def _tracked(work: Callable[[], Any]) -> Callable[[], Any]:
    """work, marking this rank idle for the stall inspector when it ends."""
    def run() -> Any:
        try:
            return work()
        finally:
            topology.get().watchdog.record.leave()
    return run


def _timed(collective: str, algorithm: str, work: Callable[[], Any]) -> Any:
    sent0, recv0 = stats.snapshot()
    result = work()
    sent1, recv1 = stats.snapshot()
    stats.record_call(collective, algorithm, sent1 - sent0, recv1 - recv0)
    return result


def _rows_split(rows: int, n: int) -> list[int]:
    """Rows per rank under Horovod's rule: the first rows % n ranks get one extra."""
    base, extra = divmod(rows, n)
    return [base + (1 if r < extra else 0) for r in range(n)]


def _row_elems(shape: tuple) -> int:
    return int(np.prod(shape[1:], dtype=np.int64))


def _need_dim0(buf: Buffer, name: str) -> None:
    if len(buf.shape) == 0:
        raise ValueError(f"{name}: needs at least one dimension (rows on dim 0), got a scalar")


def _check_root(root_rank: object) -> int:
    n = topology.size()
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= int(root_rank) < n:
        raise ValueError(f"root_rank: expected an int in [0, {n}), got {root_rank!r}")
    return int(root_rank)


# ----------------------------------------------------------------------------- allreduce

def _allreduce_work(buf: Buffer, out: Buffer, op: ReduceOp, algorithm: str,
                    compression: str) -> Callable[[], Any]:
    def work() -> Any:
        topo = topology.get()
        p = fastpath.plan(buf.dtype, buf.shape, buf.nbytes, op, algorithm, compression, topo)
        fastpath.run(p, topo, buf.flat, out.flat)
        if out is buf:
            buf.write_back()
            return buf.orig
        return out.result()

    return work


def _int8_work(buf: Buffer, x: Any, op: ReduceOp, algorithm: str,
               inplace: bool) -> Callable[[], Any]:
    """Compression.int8: quantized allgather + local sum (collectives/quantized.py)."""
    as_f32 = wrap(x.astype(np.float32) if isinstance(x, np.ndarray) else x.detach().float(), "x")

    def work() -> Any:
        topo = topology.get()
        agree(topo, "allreduce", (("op", op.name), ("dtype", buf.dtype), ("shape", buf.shape),
                                  ("algorithm", algorithm), ("compression", "int8")))
        result = _timed("allreduce", "int8",
                        lambda: quantized.allreduce(topo, as_f32.flat, op, algorithm))
        out = buf if inplace else buf.empty(buf.shape)
        store_float32(out, result)
        if inplace:
            buf.write_back()
            return buf.orig
        return out.result()

    return work


def _allreduce_prepare(x: Any, op: ReduceOp, algorithm: str, compression: Any,
                       inplace: bool) -> Callable[[], Any]:
    op = check_op(op)
    _check_algorithm(algorithm)
    compressor = check_compression(compression)
    buf = wrap(x, "x")  # type check now, in the caller's thread
    if compressor is not Compression.none and buf.dtype in ("float32", "float64", "float16",
                                                             "bfloat16"):
        if compressor is Compression.int8:
            return _int8_work(buf, x, op, algorithm, inplace)
    else:
        compressor = Compression.none  # like Horovod: only floating tensors are compressed
    sent, ctx = compressor.compress(x)
    if sent is not x:
        buf = wrap(sent, "x")
    direct = inplace and sent is x
    work = _allreduce_work(buf, buf if direct else buf.empty(buf.shape), op, algorithm,
                           compressor.name)
    if direct or compressor is Compression.none and not inplace:
        return work

    def finish() -> Any:
        result = compressor.decompress(work(), ctx)
        if not inplace:
            return result
        target = wrap(x, "x")
        target.flat[...] = wrap(result, "result").flat
        target.write_back()
        return x

    return finish


def allreduce(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
              compression: Any = None) -> Any:
    """Reduce x over all ranks; a new array of x's type, dtype, shape and device."""
    result = fastpath.allreduce(x, op, algorithm, compression, False)
    if result is not None:
        return result
    return _run("allreduce", _allreduce_prepare(x, op, algorithm, compression, False))


def allreduce_(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
               compression: Any = None) -> Any:
    """Reduce x over all ranks in place; returns x."""
    if fastpath.allreduce(x, op, algorithm, compression, True) is not None:
        return x
    return _run("allreduce", _allreduce_prepare(x, op, algorithm, compression, True))


def allreduce_async(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
                    compression: Any = None) -> Handle:
    return _submit("allreduce", _allreduce_prepare(x, op, algorithm, compression, False))


def allreduce_async_(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto",
                     compression: Any = None) -> Handle:
    return _submit("allreduce", _allreduce_prepare(x, op, algorithm, compression, True))


# ----------------------------------------------------------------------------- allgather

def _allgather_prepare(x: Any, algorithm: str) -> Callable[[], Any]:
    _check_algorithm(algorithm)
    buf = wrap(x, "x")
    _need_dim0(buf, "x")

    def work() -> Any:
        topo = topology.get()
        rows = agree_rows(topo, "allgather", (("dtype", buf.dtype), ("row_shape", buf.shape[1:]),
                                              ("algorithm", algorithm)), buf.shape[0])
        elems = _row_elems(buf.shape)
        counts = [int(r) * elems for r in rows]
        out = buf.empty((int(rows.sum()),) + buf.shape[1:])
        algo = _resolve(algorithm, "allgather", out.nbytes)
        _timed("allgather", algo,
               lambda: algorithms.allgather(algo, topo, buf.flat, out.flat, counts))
        return out.result()

    return work


def allgather(x: Any, algorithm: str = "auto") -> Any:
    """Every rank's x concatenated on dim 0 in rank order (dim 0 may differ per rank)."""
    return _run("allgather", _allgather_prepare(x, algorithm))


def allgather_async(x: Any, algorithm: str = "auto") -> Handle:
    return _submit("allgather", _allgather_prepare(x, algorithm))


# ------------------------------------------------------------------------- reducescatter

def _reducescatter_prepare(x: Any, op: ReduceOp, algorithm: str) -> Callable[[], Any]:
    op = check_op(op)
    _check_algorithm(algorithm)
    buf = wrap(x, "x")
    _need_dim0(buf, "x")

    def work() -> Any:
        topo = topology.get()
        agree(topo, "reducescatter", (("op", op.name), ("dtype", buf.dtype),
                                      ("shape", buf.shape), ("algorithm", algorithm)))
        rows = _rows_split(buf.shape[0], topo.size)
        elems = _row_elems(buf.shape)
        counts = [r * elems for r in rows]
        out = buf.empty((rows[topo.rank],) + buf.shape[1:])
        algo = _resolve(algorithm, "reducescatter", buf.nbytes)

        def move() -> None:
            algorithms.reducescatter(algo, topo, buf.flat, out.flat, counts, kernel_op(op),
                                   buf.dtype)
            if op is ReduceOp.Average and topo.size > 1:
                kernels.divide(out.flat, buf.dtype, topo.size)

        _timed("reducescatter", algo, move)
        return out.result()

    return work


def reducescatter(x: Any, op: ReduceOp = ReduceOp.Average, algorithm: str = "auto") -> Any:
    """This rank's rows of the reduction of x over all ranks (Horovod's row split)."""
    return _run("reducescatter", _reducescatter_prepare(x, op, algorithm))


def reducescatter_async(x: Any, op: ReduceOp = ReduceOp.Average,
                        algorithm: str = "auto") -> Handle:
    return _submit("reducescatter", _reducescatter_prepare(x, op, algorithm))


# ----------------------------------------------------------------------------- broadcast

def _broadcast_prepare(x: Any, root_rank: int, algorithm: str, inplace: bool) -> Callable[[], Any]:
    _check_algorithm(algorithm)
    root = _check_root(root_rank)
    buf = wrap(x, "x")

    def work() -> Any:
        topo = topology.get()
        agree(topo, "broadcast", (("dtype", buf.dtype), ("shape", buf.shape),
                                  ("root_rank", root), ("algorithm", algorithm)))
        if inplace:
            out = buf
        else:
            out = buf.empty(buf.shape)
            out.flat[...] = buf.flat
        algo = _resolve(algorithm, "broadcast", buf.nbytes)
        _timed("broadcast", algo, lambda: algorithms.broadcast(algo, topo, out.flat, root))
        if inplace:
            buf.write_back()
            return buf.orig
        return out.result()

    return work


def broadcast(x: Any, root_rank: int = 0, algorithm: str = "auto") -> Any:
    """root_rank's x on every rank, as a new array."""
    return _run("broadcast", _broadcast_prepare(x, root_rank, algorithm, False))


def broadcast_(x: Any, root_rank: int = 0, algorithm: str = "auto") -> Any:
    """Overwrite x with root_rank's x on every rank; returns x."""
    return _run("broadcast", _broadcast_prepare(x, root_rank, algorithm, True))


def broadcast_async(x: Any, root_rank: int = 0, algorithm: str = "auto") -> Handle:
    return _submit("broadcast", _broadcast_prepare(x, root_rank, algorithm, False))


def broadcast_async_(x: Any, root_rank: int = 0, algorithm: str = "auto") -> Handle:
    return _submit("broadcast", _broadcast_prepare(x, root_rank, algorithm, True))


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """root_rank's picklable obj on every rank."""
    root = _check_root(root_rank)

    def work() -> Any:
        topo = topology.get()
        comm = topo.comm
        agree(topo, "broadcast_object", (("root_rank", root),))
        payload, error = b"", None
        if comm.Get_rank() == root:
            try:
                payload = pickle.dumps(obj)
            except Exception as exc:  # every rank must learn of it, not only the root
                error = exc
        size = comm.bcast(-1 if error else len(payload), root=root)
        if size < 0:
            raise ValueError(f"obj: root_rank {root}'s object cannot be pickled") from error
        data = np.frombuffer(payload, dtype=np.uint8).copy() if payload else np.empty(size, np.uint8)
        _timed("broadcast_object", "mpi", lambda: algorithms.broadcast("mpi", topo, data, root))
        return obj if comm.Get_rank() == root else pickle.loads(data.tobytes())

    return _run("broadcast_object", work)


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
