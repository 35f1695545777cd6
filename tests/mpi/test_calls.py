"""collectives/api/calls.py: a call's description is made once per communicator and per
distinct (collective, fields, algorithm) and counts on its own communicator's stats; a
name is one more agreed field; a call whose argument check failed on one rank still takes
part in the agreement, so that rank raises its own error, the others a MismatchError
naming it, and the next call finds every rank in step; past MAX_CALLS the table starts
over. Calls of our own ("calls_test") run through the engine as the library's do."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import assert_equal, until
from mpi4py import MPI

import collectives as C
from collectives.api import calls
from collectives.runtime import topology
from collectives.runtime.engine import ENGINE, Handle, Job

pytestmark = pytest.mark.mpi

def _result(handle: Handle) -> Any:
    until(handle.done, f"{handle.name}: done")
    return C.synchronize(handle)


def _make(topo: topology.Topology, tag: str, value: Any) -> tuple[calls.Call, Job]:
    """A call of ours, agreed on tag, whose data phase returns value."""
    return calls.describe(topo, "calls_test", (("tag", tag),), "test"), Job(lambda: value)


def _run(topo: topology.Topology, tag: str, value: Any, name: str | None = None) -> Any:
    with calls.Prepared(topo, "calls_test", name) as p:
        p.call, p.job = _make(topo, tag, value)
    return p.run()


def _submit(make: Any, *args: Any) -> Any:
    topo = topology.get()
    with calls.Prepared(topo, "calls_test", None) as p:
        p.call, p.job = make(topo, *args)
    return p.submit()


def _in_step(comm: MPI.Comm, dup: MPI.Comm | None = None) -> None:
    """Every rank runs the next call (of ours, then an allreduce) over dup (None: the job)
    and gets the right result."""
    assert _run(topology.of(dup), "next", comm.Get_rank()) == comm.Get_rank()
    got = C.allreduce(np.arange(5.0), op=C.Sum, comm=dup)
    assert_equal(got, np.arange(5.0) * comm.Get_size(), "the call after")


@pytest.fixture
def other(comm):
    """A second communicator over the same ranks, with its own Topology; freed after."""
    dup = comm.Dup()
    yield dup, topology.of(dup)
    dup.Free()


# ------------------------------------------------------------------------------ caching

def test_a_description_is_made_once_per_distinct_call(comm):
    topo = topology.get()
    a = calls.describe(topo, "calls_test", (("tag", "a"), ("n", 1)), "test")
    assert calls.describe(topo, "calls_test", (("tag", "a"), ("n", 1)), "test") is a
    others = [calls.describe(topo, "calls_test", (("tag", "a"), ("n", 2)), "test"),  # fields
              calls.describe(topo, "calls_test", (("tag", "a"), ("n", 1)), "other"),  # algorithm
              calls.describe(topo, "calls_test2", (("tag", "a"), ("n", 1)), "test")]  # collective
    assert all(o is not a for o in others) and len({id(o) for o in others}) == 3
    assert (a.collective, a.fields, a.algorithm) == ("calls_test", (("tag", "a"), ("n", 1)), "test")
    size = len(calls.of(topo).described)
    for _ in range(3):  # the public path finds its description too
        C.allreduce(np.ones(3), op=C.Sum, algorithm="ring", name="cached")
    grown = len(calls.of(topo).described)
    C.allreduce(np.ones(3), op=C.Sum, algorithm="ring", name="cached")
    assert len(calls.of(topo).described) == grown and grown > size


def test_descriptions_are_per_communicator_and_count_on_its_stats(comm, other):
    dup, topo2 = other
    job = topology.get()
    fields = (("tag", "per-comm"),)
    mine = calls.describe(job, "calls_test", fields, "test")
    theirs = calls.describe(topo2, "calls_test", fields, "test")
    assert theirs is not mine and calls.describe(topo2, "calls_test", fields, "test") is theirs
    before = C.stats()["per_op"].get("calls_test/test", {}).get("calls", 0)
    assert ENGINE.run(topo2, theirs, Job(lambda: "ran")) == "ran"
    assert C.stats(comm=dup)["per_op"]["calls_test/test"]["calls"] == 1
    assert C.stats()["per_op"].get("calls_test/test", {}).get("calls", 0) == before
    _in_step(comm, dup)


# -------------------------------------------------------------------------------- names

def test_a_name_is_one_more_field(comm):
    topo = topology.get()
    plain = calls.describe(topo, "calls_test", (("tag", "named"),), "test")
    named = calls.named(topo, plain, "step-1")
    assert named.fields == plain.fields + (("name", "step-1"),)
    assert (named.collective, named.algorithm) == (plain.collective, plain.algorithm)
    assert plain.fields == (("tag", "named"),), "the unnamed description must not change"
    assert calls.named(topo, plain, "step-1") is named
    assert calls.named(topo, plain, "step-2").fields[-1] == ("name", "step-2")
    assert _run(topo, "named", 7, name="step-1") == 7


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("who", ["first", "last"])
def test_a_name_differing_across_ranks_is_a_mismatch_everywhere(comm, who):
    r, n = comm.Get_rank(), comm.Get_size()
    odd = 0 if who == "first" else n - 1
    name = "odd-one" if r == odd else "step"
    with pytest.raises(C.MismatchError) as info:
        _run(topology.get(), "names", r, name=name)
    text = str(info.value)
    assert "calls_test name mismatch" in text and f"rank {odd} has 'odd-one'" in text, text
    assert len(set(comm.allgather(text))) == 1, "the same message on every rank"
    _in_step(comm)


# ---------------------------------------------------------------------- invalid calls

def _checked(topo: topology.Topology, bad: bool, error: Exception, made: list) -> tuple:
    """_make, after an argument check that fails where bad."""
    if bad:
        made.append(error)
        raise error
    return _make(topo, "checked", "ran")


ERRORS = [ValueError("x: expected a positive count, got -3"),
          TypeError("x: expected a numpy.ndarray, got list")]


@pytest.mark.parametrize("error", ERRORS, ids=["ValueError", "TypeError"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_bad_argument_on_one_rank_raises_on_every_rank(comm, error, where):
    r, n = comm.Get_rank(), comm.Get_size()
    bad = 0 if where == "first" else n - 1
    topo, made = topology.get(), []
    size = len(calls.of(topo).described)
    with calls.Prepared(topo, "calls_test", None) as p:
        p.call, p.job = _checked(topo, r == bad, error, made)
    if r == bad:
        assert p.call.algorithm == calls.INVALID
        assert len(calls.of(topo).described) == size, "an invalid call is not cached"
    with pytest.raises((ValueError, TypeError)) as info:
        p.run()
    if r == bad:
        assert info.value is made[0], "the bad rank raises its own error"
    else:
        assert isinstance(info.value, C.MismatchError), repr(info.value)
        want = f"calls_test: rank {bad} passed an invalid argument ({type(error).__name__}: {error})"
        assert want in str(info.value), str(info.value)
    _in_step(comm)


def test_a_name_that_is_not_a_str_is_a_bad_argument(comm):
    """A TypeError on the rank that passed it (the last), a MismatchError naming it on the
    others."""
    r, n = comm.Get_rank(), comm.Get_size()
    if r == n - 1:
        with pytest.raises(TypeError, match="^name: expected a str, got int$") as info:
            _run(topology.get(), "badname", r, name=3)
        assert not isinstance(info.value, C.MismatchError)
    else:
        with pytest.raises(C.MismatchError, match=rf"rank {n - 1} passed an invalid argument "
                                                  r"\(TypeError: name: expected a str, got int\)"):
            _run(topology.get(), "badname", r, name="fine")
    _in_step(comm)


@pytest.mark.parametrize("where", ["first", "last"])
def test_an_async_call_with_a_bad_argument(comm, where):
    """submit(): the bad rank raises at once; the others' handles raise MismatchError."""
    r, n = comm.Get_rank(), comm.Get_size()
    bad = 0 if where == "first" else n - 1
    error, made = ValueError("x: expected a positive count, got -3"), []
    if r == bad:
        with pytest.raises(ValueError) as info:
            _submit(_checked, True, error, made)
        assert info.value is made[0]
    else:
        handle = _submit(_checked, False, error, made)
        with pytest.raises(C.MismatchError, match=f"rank {bad} passed an invalid argument"):
            _result(handle)
    _in_step(comm)


# ------------------------------------------------------------------------------- MAX_CALLS

def test_the_table_starts_over_past_max_calls(comm, other, monkeypatch):
    dup, topo = other
    monkeypatch.setattr(calls, "MAX_CALLS", 4)
    x = np.arange(6.0)
    assert_equal(C.allreduce(x, op=C.Sum, comm=dup), x * comm.Get_size(), "first")
    calls.of(topo).described.clear()
    first = [calls.describe(topo, "calls_test", (("tag", f"t{i}"),), "test") for i in range(4)]
    assert len(calls.of(topo).described) == 4
    assert all(calls.describe(topo, "calls_test", (("tag", f"t{i}"),), "test") is first[i]
               for i in range(4)), "kept while under MAX_CALLS"
    fifth = calls.describe(topo, "calls_test", (("tag", "t4"),), "test")
    assert list(calls.of(topo).described.values()) == [fifth], "past MAX_CALLS the table starts over"
    assert not calls.of(topo).fast, "the fast entries go with their descriptions"
    again = calls.describe(topo, "calls_test", (("tag", "t0"),), "test")
    assert again is not first[0] and (again.fields, again.algorithm) == (first[0].fields, "test")
    assert len(calls.of(topo).described) == 2
    # descriptions made before and after the start-over still run, on every rank
    assert ENGINE.run(topo, first[1], Job(lambda: 1)) == 1
    assert ENGINE.run(topo, again, Job(lambda: 2)) == 2
    for i in range(3):
        assert_equal(C.allreduce(x + i, op=C.Sum, comm=dup), (x + i) * comm.Get_size(), f"after {i}")
    assert len(calls.of(topo).described) <= 4
