"""Several communicators in one process: every call takes `comm`, and each communicator has
its own agreement channel, described calls, stats and shm window."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_equal, assert_same_on_all_ranks
from mpi4py import MPI

import collectives as C
from collectives.runtime import topology


@pytest.fixture
def halves(comm):
    """Even and odd world ranks, each their own communicator."""
    sub = comm.Split(comm.Get_rank() % 2, key=comm.Get_rank())
    yield sub
    sub.Free()


@pytest.mark.parametrize("algo", list(C.ALGORITHMS))
def test_calls_on_a_sub_communicator_interleave_with_the_jobs(comm, halves, algo):
    r, n = comm.Get_rank(), comm.Get_size()
    members = [q for q in range(n) if q % 2 == r % 2]
    if algo == "shm" and len(topology.of(halves).nodes) > 1:
        pytest.skip("shm needs one node")
    world_algo = "auto" if algo == "shm" and len(topology.get().nodes) > 1 else algo
    for count in (0, 1, 5, 3000, 40000):  # small ones ride in the agreement
        x = np.full(count, float(r + 1))
        sub = C.allreduce(x, op=C.Sum, algorithm=algo, comm=halves)
        world = C.allreduce(x, op=C.Sum, algorithm=world_algo)
        again = C.allreduce(x, op=C.Sum, algorithm=algo, comm=halves)  # the fast entry
        assert_equal(sub, np.full(count, float(sum(q + 1 for q in members))), "sub")
        assert_equal(again, sub, "sub again")
        assert_equal(world, np.full(count, float(n * (n + 1) // 2)), "world")
    rows = C.allgather(np.full((r + 1, 2), r, np.int32), algorithm=algo, comm=halves)
    expected = np.concatenate([np.full((q + 1, 2), q, np.int32) for q in members])
    assert_equal(rows, expected, "allgather")
    got = C.broadcast(np.full(4, r, np.int64), root_rank=len(members) - 1, algorithm=algo,
                      comm=halves)
    assert_equal(got, np.full(4, members[-1], np.int64), "broadcast")
    part = C.reducescatter(np.ones((len(members) * 2, 3), np.float32), op=C.Sum,
                           algorithm=algo, comm=halves)
    assert_equal(part, np.full((2, 3), len(members), np.float32), "reducescatter")
    assert_same_on_all_ranks(comm, C.allreduce(np.arange(7.0), algorithm=world_algo), "world")


def test_async_calls_on_two_communicators_keep_submission_order(comm, halves):
    r, n = comm.Get_rank(), comm.Get_size()
    members = [q for q in range(n) if q % 2 == r % 2]
    big = np.full(1 << 16, float(r), np.float32)
    handles = []
    for i in range(6):
        target = halves if i % 2 else None
        handles.append((target, C.allreduce_async(big + i, op=C.Sum, comm=target)))
    for i, (target, h) in enumerate(handles):
        ranks = members if target is not None else range(n)
        assert_equal(C.synchronize(h), np.full(1 << 16, float(sum(ranks) + i * len(ranks)),
                                               np.float32), f"async {i}")


def test_stats_and_descriptions_are_per_communicator(comm, halves):
    before_world, before_sub = C.stats(), C.stats(halves)
    C.allreduce(np.ones(8, np.float32), op=C.Sum, algorithm="tree", comm=halves)
    C.allreduce(np.ones(8, np.float32), op=C.Sum, algorithm="tree", comm=halves)
    after_world, after_sub = C.stats(), C.stats(halves)
    assert after_world["calls"] == before_world["calls"]
    assert after_sub["calls"] == before_sub["calls"] + 2
    assert topology.of(halves) is topology.of(halves) is not topology.get()
    assert topology.of(halves).size == halves.Get_size()


def test_a_mismatch_on_one_communicator_leaves_the_others_usable(comm, halves):
    r = comm.Get_rank()
    if halves.Get_size() > 1:
        with pytest.raises(C.MismatchError, match="shape mismatch"):
            C.allreduce(np.zeros(3 + (halves.Get_rank() == 0)), comm=halves)
    n = comm.Get_size()
    assert_equal(C.allreduce(np.full(2, float(r)), op=C.Sum), np.full(2, n * (n - 1) / 2), "world")
    assert_equal(C.allreduce(np.ones(2), op=C.Sum, comm=halves),
                 np.full(2, float(halves.Get_size())), "sub")


def test_freeing_the_users_communicator_frees_ours(comm):
    mine = comm.Dup()
    topo = topology.of(mine)
    C.allreduce(np.ones(3), comm=mine)
    ours = topo.comm
    mine.Free()
    assert ours == MPI.COMM_NULL  # our duplicate went with it


def test_bad_comm_raises():
    with pytest.raises(TypeError, match="comm"):
        C.allreduce(np.ones(2), comm="world")
