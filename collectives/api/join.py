"""join(): training on uneven data. A rank that has run out of batches calls join(); until
every rank has joined, the allreduces the others still make complete, the joined ranks
contributing the reduction's identity (zeros for Sum and Average, as in Horovod) and Average
dividing by the ranks that contributed.

How: a joined rank takes part in every agreement exchange as `joined` (no data of its own,
csrc/runtime/agree.h). An exchange that meets joined ranks tells every rank how many there
are and which active rank is lowest; that rank sends the call's signature to all
(agreement.share_with_joined), and each joined rank runs its part of the data movement with
an identity buffer (below) when the data did not already ride in the exchange. The exchange
in which every rank is joined ends join() everywhere. Only reductions may run meanwhile: any
other call raises MismatchError on the ranks that made it (agreement.JOINABLE), and the
joined ranks wait on, as in Horovod; so do they when the others' calls disagree.

Cost: nothing while no rank has joined (the counts ride in the agreement header); while
some have, one broadcast of the call's signature per call."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from collectives import algorithms
from collectives.api import calls, on_device, process_sets
from collectives.auto import online, select
from collectives.compression import Compression, by_name
from collectives.dtypes import FLOATING, STORAGE
from collectives.ops import ReduceOp
from collectives.runtime import agreement, faults
from collectives.runtime.buffers import host_float
from collectives.runtime.engine import ENGINE
from collectives.runtime.topology import Topology

#: bfloat16 bit patterns (its storage is uint16) of the identities below.
_BF16_BITS = {0.0: 0x0000, 1.0: 0x3F80, np.inf: 0x7F80, -np.inf: 0xFF80}


def identity(op: ReduceOp, dtype: str, count: int) -> np.ndarray:
    """count elements of dtype's storage holding op's identity: 0 (Sum, Average), 1
    (Product), the largest value (Min), the smallest (Max)."""
    storage = STORAGE[dtype]
    if dtype in FLOATING:
        value = {ReduceOp.Min: np.inf, ReduceOp.Max: -np.inf,
                 ReduceOp.Product: 1.0}.get(op, 0.0)
        if dtype == "bfloat16":
            value = _BF16_BITS[value]
    else:
        info = np.iinfo(storage)
        value = {ReduceOp.Min: info.max, ReduceOp.Max: info.min,
                 ReduceOp.Product: 1}.get(op, 0)
    return np.full(count, value, storage)


def _contribute(topo: Topology, collective: str, fields: tuple) -> None:
    """A joined rank's part of an active call (a reduction, agreement.JOINABLE): the same
    data movement, from an identity buffer, its result dropped."""
    f = dict(fields)
    shapes = f["shapes"] if collective == "grouped_allreduce" else (f["shape"],)
    op, dtype, algorithm = ReduceOp[f["op"]], f["dtype"], f["algorithm"]
    count = sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
    data = identity(op, dtype, count)
    if f.get("memory") == "device":
        on_device.contribute(topo, op, dtype, data)
        return
    compressor = by_name(f["compression"])
    if compressor is not Compression.none and dtype in FLOATING:
        compressor.allreduce(topo, host_float(data, dtype), op, algorithm)
        return
    algo = select.concrete(topo, "allreduce", algorithm, data.nbytes, f.get("in_place", False))
    if not calls.riding(topo, algo, data.nbytes):  # else it was reduced in the exchange
        algorithms.reduce(algo, topo, data, data, op, dtype)


def join(*, comm: Any = None, process_set: Any = None) -> int:
    """Declare that this rank has no more work: take part, with no data, in the reductions
    the other ranks still make, until every rank has joined. Returns the rank that joined
    last (its replica saw every step: broadcast from it to make replicas equal again).

    Call it with no async collectives in flight on this rank (synchronize them first)."""
    topo = process_sets.resolve(comm, process_set)
    native = ENGINE.native
    if not native.try_claim():
        raise RuntimeError("join: collectives submitted before it are still in flight on this "
                           "rank; synchronize() them before calling join()")
    try:
        call = calls.describe(topo, "join", (), "agreement")
        first = True
        while True:
            ok, joined, first_active, last = native.join_step(topo.channel, call.native, first)
            first = False
            if not ok:  # the others disagree among themselves: they raise, this rank waits on
                try:
                    agreement.raise_mismatch(topo.comm, "join", ())
                except agreement.MismatchError:
                    continue
            if joined == topo.size:
                online.rejoined(topo)
                return last
            collective, fields = topo.comm.bcast(None, root=first_active)
            try:
                agreement.check_joinable(collective, fields, joined, topo.size)
            except agreement.MismatchError:
                continue  # the others raise it; this rank waits on, as in Horovod
            native.contribute(joined, functools.partial(_contribute, topo, collective, fields))
    except Exception as exc:  # a failure of ranks: RanksFailedError (fault-tolerant mode)
        faults.reraise(topo, exc)
    finally:
        native.release()
