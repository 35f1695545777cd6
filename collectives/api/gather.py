"""allgather (and grouped), broadcast, the object collectives, alltoall and barrier."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from collectives import algorithms
from collectives.api import calls, process_sets
from collectives.api.base import (
    check_algorithm,
    check_list,
    check_root,
    need_dim0,
    one_dtype,
    row_elems,
)
from collectives.api.calls import Call, Prepared
from collectives.auto import select
from collectives.dtypes import CODES, STORAGE, loaded_torch
from collectives.ops import ReduceOp
from collectives.runtime import topology
from collectives.runtime.agreement import PIGGYBACK_BYTES
from collectives.runtime.buffers import Buffer, wrap
from collectives.runtime.engine import ENGINE, Handle, Job

_INT64 = CODES["int64"]

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


def _prepared(topo: topology.Topology, name: str | None, collective: str,
              make: Callable[..., tuple[Call, Job]], *args: Any) -> Prepared:
    """The call make(topo, *args) describes, prepared in the public function's stead
    (calls.Prepared: no layer below calls back into this module to make it)."""
    with Prepared(topo, collective, name) as p:
        p.call, p.job = make(topo, *args)
    return p


def _allgather(topo: topology.Topology, x: Any, algorithm: Any,
               out: Any = None) -> tuple[Call, Job]:
    check_algorithm(algorithm)
    buf = wrap(x, "x")
    need_dim0(buf, "x")
    into = None if out is None else _check_out(out, buf)
    fields = (("dtype", buf.dtype), ("row_shape", buf.shape[1:]), ("algorithm", algorithm)) \
        + (() if into is None else (("out", True),))
    call = calls.describe(topo, "allgather", fields, algorithm)
    # every rank's dim 0, and with out, its dim 0 (checked alike on every rank)
    rows = _FromEveryRank(topo, [buf.shape[0]] + ([] if into is None else [into.shape[0]]))

    def move() -> Any:
        table = rows.values()
        everyone = table[:, 0].tolist()
        elems = row_elems(buf.shape)
        counts = [r * elems for r in everyone]
        if into is not None and (table[:, 1] != sum(everyone)).any():
            wrong = [(q, int(n)) for q, n in enumerate(table[:, 1]) if n != sum(everyone)]
            raise ValueError(f"out: expected {sum(everyone)} rows (every rank's x), got "
                             f"(rank, rows) {wrong}")
        result = buf.empty((sum(everyone),) + buf.shape[1:]) if into is None else into
        algo = select.concrete(topo, "allgather", algorithm, result.nbytes)
        ENGINE.native.credit(topo.stats, "allgather", algo)  # `auto` chose by the total size
        algorithms.allgather(algo, topo, buf.flat, result.flat, counts)
        return result.result()

    return call, rows.job(move)


def _check_out(out: Any, buf: Buffer) -> Buffer:
    """allgather's out as a buffer written in place: host memory, C-contiguous, x's dtype
    and row shape (its dim 0 is checked in the move, against every rank's x)."""
    into = wrap(out, "out")
    if into.staged or into.pinned is not None:
        raise ValueError("out: expected a C-contiguous host array, written in place")
    if into.dtype != buf.dtype or len(into.shape) == 0 or into.shape[1:] != buf.shape[1:]:
        raise ValueError(f"out: expected dtype {buf.dtype} and rows of shape "
                         f"{buf.shape[1:]} (as x), got dtype {into.dtype} and shape "
                         f"{into.shape}")
    if np.shares_memory(into.flat, buf.flat):
        raise ValueError("out: must not overlap x")
    return into


def allgather(x: Any, algorithm: str = "auto", *, out: Any = None, name: str | None = None,
              comm: Any = None, process_set: Any = None) -> Any:
    """Every rank's x concatenated on dim 0 in rank order (dim 0 may differ per rank).
    out: where to write it (a C-contiguous host array or tensor of x's dtype, its dim 0
    every rank's rows together), returned instead of a new array (as torch's
    all_gather_into_tensor)."""
    topo = process_sets.resolve(comm, process_set)
    return _prepared(topo, name, "allgather", _allgather, x, algorithm, out).run()


def _grouped_allgather(topo: topology.Topology, tensors: Any,
                       algorithm: Any) -> tuple[Call, Job]:
    check_algorithm(algorithm)
    check_list(tensors)
    bufs = [wrap(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    for i, b in enumerate(bufs):
        need_dim0(b, f"tensors[{i}]")
    dtype = one_dtype(bufs)
    n, k = topo.size, len(bufs)
    fields = (("dtype", dtype), ("row_shapes", tuple(b.shape[1:] for b in bufs)),
              ("algorithm", algorithm))
    call = calls.describe(topo, "grouped_allgather", fields, algorithm)
    rows = _FromEveryRank(topo, [b.shape[0] for b in bufs])  # each tensor's dim 0

    def move() -> list:
        everyone = rows.values()  # [q, i]: rank q's dim 0 of tensor i
        elems = np.array([row_elems(b.shape) for b in bufs], np.int64)
        sizes = everyone * elems  # elements of tensor i from rank q
        send = np.concatenate([b.flat for b in bufs]) if bufs else np.empty(0, STORAGE[dtype])
        recv = np.empty(int(sizes.sum()), STORAGE[dtype])
        algo = select.concrete(topo, "allgather", algorithm, recv.nbytes)
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
    return _prepared(topo, name, "grouped_allgather", _grouped_allgather, tensors, algorithm).run()


def allgather_async(x: Any, /, algorithm: str = "auto", *, out: Any = None,
                    name: str | None = None, comm: Any = None,
                    process_set: Any = None) -> Handle:
    """allgather queued on the engine: a Handle at once, whose synchronize(handle) is the
    result (out, if given, must stay untouched until then)."""
    topo = process_sets.resolve(comm, process_set)
    return _prepared(topo, name, "allgather", _allgather, x, algorithm, out).submit()


def grouped_allgather_async(tensors: list, /, algorithm: str = "auto", *,
                            name: str | None = None, comm: Any = None,
                            process_set: Any = None) -> Handle:
    """grouped_allgather queued on the engine: a Handle at once, whose
    synchronize(handle) is the result."""
    topo = process_sets.resolve(comm, process_set)
    return _prepared(topo, name, "grouped_allgather", _grouped_allgather, tensors,
                     algorithm).submit()


# ----------------------------------------------------------------------------- broadcast

def _broadcast(topo: topology.Topology, x: Any, root_rank: Any, algorithm: Any,
               inplace: bool, ranks: list[int] | None) -> tuple[Call, Job]:
    check_algorithm(algorithm)
    root = check_root(root_rank, topo, ranks)
    buf = wrap(x, "x")
    fields = (("dtype", buf.dtype), ("shape", buf.shape), ("root_rank", root),
              ("algorithm", algorithm))
    call = calls.describe(topo, "broadcast", fields,
                          select.concrete(topo, "broadcast", algorithm, buf.nbytes))

    def move() -> Any:
        out = buf if inplace else buf.empty(buf.shape)
        if not inplace:
            out.flat[...] = buf.flat
        algorithms.broadcast(call.algorithm, topo, out.flat, root)
        return buf.result_from(out)

    return call, Job(move)


def broadcast(x: Any, root_rank: int = 0, algorithm: str = "auto", *, name: str | None = None,
              comm: Any = None, process_set: Any = None) -> Any:
    """root_rank's x on every rank, as a new array."""
    topo = process_sets.resolve(comm, process_set)
    return _prepared(topo, name, "broadcast", _broadcast, x, root_rank, algorithm, False,
                     process_sets.job_ranks(process_set)).run()


def broadcast_(x: Any, root_rank: int = 0, algorithm: str = "auto", *, name: str | None = None,
               comm: Any = None, process_set: Any = None) -> Any:
    """Overwrite x with root_rank's x on every rank; returns x."""
    topo = process_sets.resolve(comm, process_set)
    return _prepared(topo, name, "broadcast", _broadcast, x, root_rank, algorithm, True,
                     process_sets.job_ranks(process_set)).run()


def _queued_broadcast(inplace: bool) -> Callable[..., Handle]:
    """broadcast's (or broadcast_'s) async variant: the same arguments (x positional), the
    call queued on the engine; a Handle at once, whose synchronize(handle) is the result."""

    def queued(x: Any, /, root_rank: int = 0, algorithm: str = "auto", *,
               name: str | None = None, comm: Any = None, process_set: Any = None) -> Handle:
        topo = process_sets.resolve(comm, process_set)
        return _prepared(topo, name, "broadcast", _broadcast, x, root_rank, algorithm, inplace,
                         process_sets.job_ranks(process_set)).submit()

    queued.__name__ = queued.__qualname__ = "broadcast_async_" if inplace else "broadcast_async"
    return queued


broadcast_async = _queued_broadcast(False)
broadcast_async_ = _queued_broadcast(True)


def _broadcast_object(topo: topology.Topology, obj: Any, root_rank: Any,
                      ranks: list[int] | None) -> tuple[Call, Job]:
    root = check_root(root_rank, topo, ranks)
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
    return _prepared(topo, name, "broadcast_object", _broadcast_object, obj, root_rank,
                     process_sets.job_ranks(process_set)).run()


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
        algo = select.concrete(topo, "allgather", "auto", recv.nbytes)
        ENGINE.native.credit(topo.stats, "allgather_object", algo)
        algorithms.allgather(algo, topo, payload, recv, everyone.tolist())
        starts = np.concatenate([[0], np.cumsum(everyone)])
        return [pickle.loads(recv[starts[q]:starts[q + 1]].tobytes()) for q in range(n)]

    return call, sizes.job(move)


def allgather_object(obj: Any, *, name: str | None = None, comm: Any = None,
                     process_set: Any = None) -> list:
    """Every rank's picklable obj, as a list in rank order."""
    topo = process_sets.resolve(comm, process_set)
    return _prepared(topo, name, "allgather_object", _allgather_object, obj).run()


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
    check_algorithm(algorithm, algorithms.ALLTOALL_ALGORITHMS)
    buf = wrap(x, "x")
    need_dim0(buf, "x")
    n, r = topo.size, topo.rank
    mine = _check_splits(splits, buf.shape[0], n)
    fields = (("dtype", buf.dtype), ("row_shape", buf.shape[1:]), ("algorithm", algorithm))
    call = calls.describe(topo, "alltoall", fields, algorithm)
    matrix = _FromEveryRank(topo, mine)  # row j: rank j's splits

    def move() -> Any:
        everyone = matrix.values().tolist()  # Python ints: cheaper than NumPy's at this size
        received = [row[r] for row in everyone]
        elems = row_elems(buf.shape)
        out = buf.empty((sum(received),) + buf.shape[1:])
        per_rank = sum(map(sum, everyone)) * elems * buf.flat.itemsize // n  # auto: agreed
        algo = select.concrete(topo, "alltoall", algorithm, per_rank)
        ENGINE.native.credit(topo.stats, "alltoall", algo)
        algorithms.alltoall(algo, topo, buf.flat, out.flat, [c * elems for c in mine],
                            [c * elems for c in received])
        if splits is None:
            return out.result()
        got = np.array(received, np.int32)
        return out.result(), (loaded_torch().from_numpy(got) if buf.kind == "torch" else got)

    return call, matrix.job(move)


def alltoall(x: Any, splits: Any = None, algorithm: str = "auto", *, name: str | None = None,
             comm: Any = None, process_set: Any = None) -> Any:
    """Rank r sends rows splits[j] of x's dim 0 (in order) to rank j; splits None: an even
    split. Returns the rows received, in rank order, and, when splits is given, the number
    received from each rank (int32, as Horovod does)."""
    topo = process_sets.resolve(comm, process_set)
    return _prepared(topo, name, "alltoall", _alltoall, x, splits, algorithm).run()


def alltoall_async(x: Any, splits: Any = None, algorithm: str = "auto", *,
                   name: str | None = None, comm: Any = None,
                   process_set: Any = None) -> Handle:
    topo = process_sets.resolve(comm, process_set)
    return _prepared(topo, name, "alltoall", _alltoall, x, splits, algorithm).submit()


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
    _prepared(topo, name, "barrier", _barrier).run()


