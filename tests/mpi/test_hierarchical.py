"""The two-level allreduce cut into chunks (algorithms/hierarchical.py): every chunk through
the node and cross-node steps, the cross-node steps on a thread of their own. Chunks are
made small here (chunks() patched) so that a few KiB already take many of them, with
counts that leave uneven chunks and shards; the results must be those of the independent
reference, bit-identical on every rank and equal, bit for bit, to the same chunks run one
after another on the caller's thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import (
    assert_equal,
    assert_reduced,
    assert_same_on_all_ranks,
    make_input,
    run_case,
)
from mpi4py import MPI

import collectives as C
from collectives.algorithms import hierarchical
from collectives.runtime import topology
from collectives.runtime.window import cpus, ranks_on_machine

pytestmark = pytest.mark.mpi

DTYPES = ["float32", "float64", "int32", "int8", "float16"]
OPS = [C.Sum, C.Average, C.Max, C.Product]


@pytest.fixture
def small_chunks(monkeypatch):
    """Shards of 512 bytes, at most 9 chunks (so a large call has larger shards), whatever
    the price says of so many small chunks; pipelined where MPI allows it, on machines
    whose ranks share CPUs too (the test machines' do)."""
    monkeypatch.setattr(hierarchical, "chunks", lambda nbytes, layout, p: max(
        1, min(nbytes // (512 * layout.max_local), 9)))
    monkeypatch.setattr(topology.get(), "cpus_per_rank", 2)


def _threads_started(monkeypatch) -> list[str]:
    """The names of the threads started from here on."""
    threads = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start",
                        lambda self: (threads.append(self.name), start(self))[1])
    return threads


def _counts(itemsize: int) -> list[int]:
    per_chunk = 512 // itemsize
    return [per_chunk - 1, 2 * per_chunk + 3, 9 * per_chunk + 7, 40 * per_chunk + 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "in"])
def test_chunked_allreduce_matches_the_reference(comm, small_chunks, dtype, op, inplace):
    r = comm.Get_rank()
    for count in _counts(np.dtype(dtype).itemsize):
        x = make_input(dtype, (count,), seed=100 + r)
        what = f"hierarchical {op.name} {dtype} x{count} {'in' if inplace else 'out'}"
        fn = C.allreduce_ if inplace else C.allreduce
        before, got = run_case(lambda t: fn(t, op=op, algorithm="hierarchical"), x,  # noqa: B023
                               inplace, what)
        assert_reduced(comm, got, before, op, dtype, what)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_pipelined_is_bitwise_the_chunks_in_sequence(comm, small_chunks, monkeypatch, dtype):
    """Random floats, whose sums round: the thread changes when each step runs, not what it
    computes. The pipelined run must have used the cross-node thread where MPI allows it."""
    rng = np.random.default_rng(7 + comm.Get_rank())
    x = (rng.standard_normal(30 * 512 // np.dtype(dtype).itemsize + 5) * 1e3).astype(dtype)
    threads = _threads_started(monkeypatch)
    for op in (C.Sum, C.Average):
        pipelined = C.allreduce(x, op=op, algorithm="hierarchical")
        with monkeypatch.context() as sequential:
            sequential.setattr(hierarchical, "overlaps", lambda: False)
            in_sequence = C.allreduce(x, op=op, algorithm="hierarchical")
        assert_equal(pipelined, in_sequence, f"{op.name} {dtype} pipelined vs in sequence")
        assert_same_on_all_ranks(comm, pipelined, f"{op.name} {dtype}")
    if hierarchical.overlaps():
        assert "collectives-hierarchical" in threads


def test_ranks_sharing_cpus_run_the_chunks_in_sequence(comm, small_chunks, monkeypatch):
    """The cross-node thread runs only where every rank has two CPUs: on one, its MPI
    progress loop and the node steps take turns, slower than the chunks in sequence.
    Either way the result is the same."""
    topo = topology.get()
    x = np.arange(40 * 512 // 4, dtype=np.float32)
    expected = C.allreduce(x, op=C.Sum, algorithm="hierarchical")
    for n in (1, 2):
        monkeypatch.setattr(topo, "cpus_per_rank", n)
        threads = _threads_started(monkeypatch)
        got = C.allreduce(x, op=C.Sum, algorithm="hierarchical")
        assert_equal(got, expected, f"{n} CPUs a rank")
        threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE and n == 2
        assert ("collectives-hierarchical" in threads) == threaded, n


def test_cpus_per_rank_is_the_fewest_any_rank_has(comm):
    """The same on every rank, no more than a rank may run on, nor than an even share of
    the CPUs its machine's ranks run on."""
    topo = topology.get()
    machine = comm.Split_type(MPI.COMM_TYPE_SHARED)
    shared = set().union(*machine.allgather(cpus()))
    share = len(shared) // ranks_on_machine(machine.Get_size())
    machine.Free()
    assert comm.allgather(topo.cpus_per_rank) == [topo.cpus_per_rank] * comm.Get_size()
    assert topo.cpus_per_rank <= min(len(cpus()), comm.allreduce(share, op=MPI.MIN))


def test_an_error_on_the_cross_node_thread_reaches_the_caller(comm, small_chunks, monkeypatch):
    """Every rank's thread fails at its third chunk: the call raises that error on every
    rank instead of waiting, and the next call runs."""
    cross = hierarchical._Chunk.cross
    seen = []

    def failing(self, *args):
        seen.append(self)
        if len(seen) == 3:
            raise RuntimeError("cross-node step failed")
        cross(self, *args)

    x = np.arange(40 * 512 // 4, dtype=np.float32)
    with monkeypatch.context() as patched:
        patched.setattr(hierarchical._Chunk, "cross", failing)
        with pytest.raises(RuntimeError, match="cross-node step failed"):
            C.allreduce(x, op=C.Sum, algorithm="hierarchical")
    assert_equal(C.allreduce(x, op=C.Sum, algorithm="hierarchical"), x * comm.Get_size(),
                 "the call after the error")
