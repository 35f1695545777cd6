"""Call descriptions: everything derived from a call's agreed arguments, made once per
distinct call and kept per communicator (Calls, this module's state on its Topology).

A description holds the fields every rank must agree on, their digest (the agreement
checks it), the concrete algorithm (`auto` resolved: a function of agreed values, so the
same on every rank), the stats counter it counts on and, for an allreduce whose data rides
in the agreement exchange (riding()) or that runs shm's pipeline after a shared-memory
exchange, the C++ fast entry that runs the whole call (`_C.FastAllreduce`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

from collectives.algorithms import shm
from collectives.auto import select
from collectives.auto import state as auto_state
from collectives.dtypes import CODES, STORAGE
from collectives.kernels import _C
from collectives.ops import KERNEL_OP, ReduceOp
from collectives.runtime import agreement
from collectives.runtime.engine import ENGINE, Job
from collectives.runtime.topology import Topology

#: Descriptions kept per communicator; past this the table starts over.
MAX_CALLS = 4096
#: The algorithm of a call whose arguments were bad on this rank (invalid()).
INVALID = "invalid"


class Calls:
    """What the api keeps per communicator: its descriptions (by a key cheaper to build than
    their fields) and the allreduce fast entries (by (op, dtype, shape, algorithm,
    in place), read by api/allreduce.py's fast path)."""

    __slots__ = ("described", "fast")

    def __init__(self) -> None:
        self.described: dict[tuple, Call] = {}
        self.fast: dict[tuple, Call] = {}


def of(topo: Topology) -> Calls:
    """topo's descriptions and fast entries."""
    return topo.state(Calls)


def take_fast(topo: Topology, key: tuple, call: Call) -> None:
    """The next host allreduce of key on topo takes call's fast entry."""
    topo.state(Calls).fast[key] = call


def forget(topo: Topology, entries: bool) -> None:
    """Describe topo's calls afresh from now on (a choice they were made under changed);
    with entries, drop the fast entries too."""
    table = topo.state(Calls)
    table.described.clear()
    if entries:
        table.fast.clear()


auto_state.on_change(forget)


class Call(NamedTuple):
    collective: str
    fields: tuple          # ((name, value), ...): what every rank must pass alike
    algorithm: str         # concrete algorithm, or the stats label of a compressed call
    native: Any            # _C.Call: digest, stall-record text, counter, mismatch report
    rides: bool = False    # a reduction whose data rides in the agreement exchange
    fast: Any = None       # an allreduce's C++ fast entry (_C.FastAllreduce), where it has one
    dtype_code: int = 0    # a reduction: the kernels' codes of its payload
    op_code: int = 0
    divisor: int = 1       # world size for Average, else 1
    size_class: int = 0    # a reduction: its class (select.size_class), auto's unit


def describe(topo: Topology, collective: str, fields: tuple, algorithm: str) -> Call:
    """The description of a call of collective with these agreed fields running algorithm
    (concrete, or a stats label) on topo."""
    key = (collective, fields, algorithm)
    call = topo.state(Calls).described.get(key)
    if call is None:
        call = _remember(topo, key, Call(collective, fields, algorithm,
                                         _native(topo, collective, fields, algorithm)))
    return call


def allreduce(topo: Topology, dtype: str, shape: tuple, nbytes: int, op: ReduceOp,
              algorithm: str, inplace: bool) -> Call:
    """An uncompressed allreduce's description (raises the argument errors of concrete()),
    found by a key cheaper to build than its fields: this is on every call's path. `auto`
    settles in place and out of place apart (select.size_class), so for `auto` every rank
    must call alike: in_place is one of its agreed fields."""
    key = ("allreduce", dtype, shape, op, algorithm, inplace)
    call = topo.state(Calls).described.get(key)
    if call is None:
        fields = allreduce_fields(op, dtype, shape, algorithm, inplace)
        algo = select.concrete(topo, "allreduce", algorithm, nbytes, inplace)
        call = _remember(topo, key, _reduction(topo, "allreduce", fields, dtype, nbytes, op,
                                               algo, fast_entry=True, inplace=inplace))
    return call


def allreduce_fields(op: ReduceOp, dtype: str, shape: tuple, algorithm: str,
                     inplace: bool) -> tuple:
    """The agreed fields of an uncompressed allreduce, on host data or (with a memory field
    added, api/on_device.py) device data: the same names in the same order, so that ranks
    passing different memory disagree on `memory`, the field that tells them why."""
    fields = (("op", op.name), ("dtype", dtype), ("shape", shape), ("algorithm", algorithm),
              ("compression", "none"))
    return fields + (("in_place", inplace),) if algorithm == "auto" else fields


def reduction(topo: Topology, collective: str, fields: tuple, dtype: str, nbytes: int,
              op: ReduceOp, algo: str) -> Call:
    """The description of a reduction of nbytes of dtype other than allreduce's (a grouped
    allreduce): like allreduce's, without the C++ fast entry."""
    key = (collective, fields, algo)
    call = topo.state(Calls).described.get(key)
    if call is None:
        call = _remember(topo, key, _reduction(topo, collective, fields, dtype, nbytes, op,
                                               algo, fast_entry=False))
    return call


def _reduction(topo: Topology, collective: str, fields: tuple, dtype: str, nbytes: int,
               op: ReduceOp, algo: str, fast_entry: bool, inplace: bool = False) -> Call:
    """A reduction's Call, its data riding in the agreement where riding() says; with
    fast_entry, the C++ fast entry where the whole call can run in C++: a riding one, or
    shm's pipeline after a shared-memory exchange."""
    native = _native(topo, collective, fields, algo)
    code, kop = CODES[dtype], int(KERNEL_OP[op])
    divisor = topo.size if op is ReduceOp.Average else 1
    rides = riding(topo, algo, nbytes)
    fast = None
    if fast_entry:
        itemsize = STORAGE[dtype].itemsize
        count = nbytes // itemsize
        pipeline = shm.allreduce_pipeline(topo.comm, count, itemsize) \
            if shm.has_fast_entry(algo, topo.channel.shared) and not rides else None
        if rides or pipeline is not None:
            fast = _C.FastAllreduce(ENGINE.native, topo.channel, native, count, code, kop,
                                    divisor, pipeline)
    return Call(collective, fields, algo, native, rides, fast, code, kop, divisor,
                select.size_class(nbytes, inplace))


def riding(topo: Topology, algo: str, nbytes: int) -> bool:
    """Whether a reduction of nbytes by algo rides in topo's agreement exchange: `shm` up
    to its capacity where the exchange runs in shared memory (it is shm's single step),
    `tree` up to it where it is recursive doubling over messages (it is tree's)."""
    return algo == ("shm" if topo.channel.shared else "tree") and nbytes <= topo.channel.capacity


class Prepared:
    """A call's description and job, made in the public function's own frame:

        with Prepared(topo, "allreduce", name) as p:
            p.call, p.job = _allreduce(topo, x, ...)
        return p.run()       # or p.submit() for the async form

    so that no layer below calls back into the api module to make them. The caller's name
    for the call, if given, joins its fields (agreed like the others) when the block ends.
    If an argument check inside the block fails on this rank (TypeError / ValueError, a bad
    name too), p holds an invalid call instead, which still takes part in the agreement,
    carrying the error: every rank raises in this same call (this rank its own error, the
    others a MismatchError naming it), and the next call finds every rank in step."""

    __slots__ = ("topo", "collective", "name", "call", "job")

    def __init__(self, topo: Topology, collective: str, name: str | None):
        self.topo, self.collective, self.name = topo, collective, name
        self.call: Any = None
        self.job: Any = None

    def __enter__(self) -> Prepared:
        return self

    def run(self) -> Any:
        """The call, run after everything submitted before; its result (an argument error
        made in the block is raised here, on every rank alike)."""
        return ENGINE.run(self.topo, self.call, self.job)

    def submit(self) -> Any:
        """run()'s call queued on the engine: its Handle, at once. One whose arguments are
        bad on this rank also raises here at once (the queued call keeps the ranks in
        step)."""
        handle = ENGINE.submit(self.topo, self.call, self.job)
        if self.call.algorithm == INVALID:
            self.job.move()
        return handle

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> bool:
        if kind is None:
            if self.name is None:  # the common case first: nothing to do
                return False
            try:
                self.call = named(self.topo, self.call, self.name)
                return False
            except TypeError as exc:
                error = exc
        elif not issubclass(kind, (TypeError, ValueError)):
            return False
        self.call = invalid(self.topo, self.collective, error)
        self.job = Job(functools.partial(_reraise, error))
        return True


def named(topo: Topology, call: Call, name: object) -> Call:
    """call with ("name", name) among its fields: shown in mismatch and stall messages and
    the timeline, and agreed (ranks naming one call differently get a MismatchError)."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    key = ("named", call.collective, call.fields, call.algorithm, name)
    found = topo.state(Calls).described.get(key)
    if found is None:
        fields = call.fields + (("name", name),)
        found = _remember(topo, key, call._replace(
            fields=fields, fast=None,
            native=_native(topo, call.collective, fields, call.algorithm)))
    return found


def _reraise(exc: BaseException) -> None:
    raise exc


def invalid(topo: Topology, collective: str, error: BaseException) -> Call:
    """A call whose argument check failed on this rank with error: it still takes part in
    the agreement, its one field the error's text, so that every rank raises in this call
    (agreement.raise_invalid makes this rank raise error itself). Not cached."""
    fields = ((INVALID, f"{type(error).__name__}: {error}"),)
    report = functools.partial(agreement.raise_invalid, topo.comm, collective, fields, error)
    return Call(collective, fields, INVALID, _native(topo, collective, fields, INVALID, report))


def _native(topo: Topology, collective: str, fields: tuple, algorithm: str,
            report: Callable[[], None] | None = None) -> Any:
    """The C++ part of a description; report raises on a mismatch (default: the same
    MismatchError on every rank)."""
    if report is None:
        report = functools.partial(agreement.raise_mismatch, topo.comm, collective, fields)
    return _C.Call(agreement.digest((collective, fields)), collective, repr(dict(fields)),
                   topo.stats, algorithm, report,
                   functools.partial(agreement.share_with_joined, topo.comm, collective, fields))


def _remember(topo: Topology, key: tuple, call: Call) -> Call:
    table = topo.state(Calls)
    if len(table.described) >= MAX_CALLS:
        forget(topo, entries=True)
    table.described[key] = call
    return call
