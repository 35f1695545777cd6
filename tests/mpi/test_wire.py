"""The bytes compression/wire.py states a rank receives in each form are the bytes its
calls receive (C.stats()["bytes_received"], counted by the engine as the call's data
arrives), for an odd vector and a larger one."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives.compression import Int4Compressor, Int8Compressor, wire
from collectives.runtime import topology

#: wire's form -> a compressor made fresh for each call
MAKERS = {
    "int8 allgather": lambda: Int8Compressor("allgather"),
    "int8 two-phase": lambda: Int8Compressor("two-phase"),
    "int4 allgather": lambda: Int4Compressor("allgather"),
    "int4 two-phase": lambda: Int4Compressor("two-phase"),
    "Top-K 1%": lambda: C.Compression.topk(0.01),
}
COUNTS = (3001, 40_000)  # an odd count with a partial block, and a larger one


def _received(form: str, count: int) -> int:
    x = np.random.default_rng(count + C.rank()).standard_normal(count).astype(np.float32)
    before = C.stats()["bytes_received"]
    C.allreduce(x, compression=MAKERS[form](), algorithm="mpi")
    return C.stats()["bytes_received"] - before


@pytest.mark.parametrize("form", list(MAKERS))
def test_each_form_receives_the_bytes_wire_states(comm, form):
    """Exactly, on every rank. (1-bit's and the ring's formulas are their modules' costs'
    own terms; wire prices one level, so simulated nodes are left out.)"""
    if len(topology.get().nodes) > 1:
        pytest.skip("wire prices one level")
    n, r = comm.Get_size(), comm.Get_rank()
    got = [_received(form, count) for count in COUNTS]
    stated = [wire.received_bytes(form, n, count, rank=r) for count in COUNTS]
    assert got == stated, (form, got, stated)


def test_the_forms_that_do_not_grow_with_the_ranks():
    """At 64 MiB of float32: the two phases and 1-bit stay within their two-rank bytes
    times 2 up to 1,024 ranks, as the ring does; the allgather forms grow with the ranks."""
    count = 1 << 24
    for form in ("float32 ring", "int8 two-phase", "int4 two-phase", "1-bit"):
        assert wire.received_bytes(form, 1024, count) <= 2 * wire.received_bytes(form, 2, count)
    for form in ("int8 allgather", "int4 allgather", "Top-K 1%"):
        assert wire.received_bytes(form, 1024, count) > 500 * wire.received_bytes(form, 2, count)
