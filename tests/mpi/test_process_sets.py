"""Process sets: add/remove (collective over the job, agreed), every collective with
process_set= over the set's ranks only (root_rank a job rank), overlapping sets, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from collectives.optim import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from conftest import assert_equal, assert_same_on_all_ranks

import collectives as C


@pytest.fixture
def parity_sets(comm):
    """The even and the odd job ranks as two process sets; yields (this rank's set, its
    ranks)."""
    n, r = comm.Get_size(), comm.Get_rank()
    even = C.add_process_set([q for q in range(n) if q % 2 == 0])
    odd = C.add_process_set([q for q in range(n) if q % 2 == 1]) if n > 1 else None
    mine = even if r % 2 == 0 else odd
    yield mine, mine.ranks
    if odd is not None:
        assert C.remove_process_set(odd)
    assert C.remove_process_set(even)


def test_collectives_run_over_the_sets_ranks_only(comm, parity_sets):
    ps, ranks = parity_sets
    r, k = comm.Get_rank(), len(ranks)
    assert ps.included() and ps.size() == k and ps.rank() == ranks.index(r)
    for count in (0, 1, 7, 70000):  # riding in the agreement, and not
        got = C.allreduce(np.full(count, r + 1.0), op=C.Sum, process_set=ps)
        assert_equal(got, np.full(count, sum(q + 1.0 for q in ranks)), f"allreduce {count}")
    got = C.allgather(np.full((r + 1, 2), r, np.int64), process_set=ps)
    assert_equal(got, np.concatenate([np.full((q + 1, 2), q, np.int64) for q in ranks]),
                 "allgather")
    for root in ranks:  # root_rank is a job rank
        got = C.broadcast(np.full(5, r, np.int32), root_rank=root, process_set=ps)
        assert_equal(got, np.full(5, root, np.int32), f"broadcast from {root}")
        assert C.broadcast_object({"from": r}, root_rank=root, process_set=ps) == {"from": root}
    part = C.reducescatter(np.ones((2 * k, 3), np.float32), op=C.Sum, process_set=ps)
    assert_equal(part, np.full((2, 3), k, np.float32), "reducescatter")
    rows = C.alltoall(np.full((k, 2), r, np.int32), process_set=ps)
    assert_equal(rows, np.repeat(np.array(ranks, np.int32), 2).reshape(k, 2), "alltoall")
    grouped = C.grouped_allreduce([np.full(3, r, np.float64), np.full(4, 2.0 * r)],
                                  op=C.Sum, process_set=ps)
    assert_equal(grouped[1], np.full(4, 2.0 * sum(ranks)), "grouped_allreduce")
    C.barrier(process_set=ps)
    h = C.allreduce_async(torch.full((9,), float(r)), op=C.Max, process_set=ps)
    assert torch.equal(C.synchronize(h), torch.full((9,), float(max(ranks))))
    per_op = C.stats(process_set=ps)["per_op"]
    assert sum(v["calls"] for v in per_op.values()) >= 10


def test_overlapping_sets_interleave_with_the_job(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    low = C.add_process_set(range(max(1, n - 1)))  # every rank but the last (n > 1)
    high = C.add_process_set(range(min(1, n - 1), n))  # every rank but the first
    try:
        for i in range(3):
            x = np.full(40000, float(r + i), np.float32)
            if low.included():
                assert_equal(C.allreduce(x, op=C.Sum, process_set=low),
                             np.full(40000, float(sum(q + i for q in low.ranks)), np.float32),
                             "low")
            world = C.allreduce(x, op=C.Sum)
            assert_equal(world, np.full(40000, float(sum(q + i for q in range(n))), np.float32),
                         "world")
            if high.included():
                assert_equal(C.allreduce(x, op=C.Sum, process_set=high),
                             np.full(40000, float(sum(q + i for q in high.ranks)), np.float32),
                             "high")
    finally:
        assert C.remove_process_set(high) and C.remove_process_set(low)


def test_a_rank_outside_the_set_gets_a_clear_error(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1:
        pytest.skip("needs a rank outside the set")
    ps = C.add_process_set([0])
    try:
        if r != 0:
            assert not ps.included() and ps.rank() == -1
            with pytest.raises(ValueError, match=r"process_set: rank \d+ is not in this process "
                                                 r"set \(ranks \[0\]\)"):
                C.allreduce(np.ones(3), process_set=ps)
        else:
            assert_equal(C.allreduce(np.ones(3), op=C.Sum, process_set=ps), np.ones(3), "solo")
        assert_equal(C.allreduce(np.ones(3), op=C.Sum), np.full(3, float(n)), "job after")
    finally:
        C.remove_process_set(ps)


def test_add_and_remove_errors_are_raised_on_every_rank(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    with pytest.raises(ValueError, match=rf"process_set: ranks must be .* in \[0, {n}\), got "):
        C.add_process_set([0, n])
    with pytest.raises(TypeError, match="ranks: expected a sequence of ints"):
        C.ProcessSet(["a"])
    with pytest.raises(ValueError, match="each rank at most once"):
        C.ProcessSet([0, 0])
    with pytest.raises(TypeError, match="pass comm= instead"):
        C.ProcessSet(comm)
    if n > 1:
        with pytest.raises(C.MismatchError, match="add_process_set ranks mismatch"):
            C.add_process_set([0] if r == 0 else [0, 1])
    assert C.remove_process_set(C.global_process_set) is False
    ps = C.add_process_set([0])
    assert C.remove_process_set(ps) and ps.process_set_id is None
    with pytest.raises(ValueError, match="is not registered"):
        C.allreduce(np.ones(2), process_set=ps)
    with pytest.raises(ValueError, match="comm, process_set: pass one or the other"):
        ps2 = C.add_process_set(range(n))
        try:
            C.allreduce(np.ones(2), comm=comm, process_set=ps2)
        finally:
            C.remove_process_set(ps2)
    assert_equal(C.allreduce(np.ones(2), op=C.Sum), np.full(2, float(n)), "usable after")


def test_init_registers_process_sets(comm):
    n = comm.Get_size()
    ps = C.ProcessSet(range(n))
    C.init(process_sets=[ps])  # already initialized: registers the sets only
    try:
        assert ps.process_set_id is not None and ps.size() == n
        assert C.global_process_set.ranks == list(range(n))
        assert C.broadcast(np.arange(3) + comm.Get_rank(), root_rank=n - 1,
                           process_set=ps).tolist() == [n - 1, n, n + 1]
    finally:
        C.remove_process_set(ps)


def test_optimizer_and_broadcasts_with_a_process_set(comm, parity_sets):
    """Each set trains its own replica: parameters and optimizer state start from the set's
    last rank, gradients are averaged over the set, and the set's ranks end identical."""
    ps, ranks = parity_sets
    r = comm.Get_rank()
    torch.manual_seed(r)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    broadcast_parameters(model.state_dict(), root_rank=ranks[-1], process_set=ps)
    broadcast_optimizer_state(opt, root_rank=ranks[-1], process_set=ps)
    dist = DistributedOptimizer(opt, named_parameters=model.named_parameters(), process_set=ps)
    for step in range(3):
        dist.zero_grad()
        torch.manual_seed(100 * step + r)
        model(torch.randn(5, 4)).square().sum().backward()
        dist.step()
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    everyone = comm.allgather(mine)
    for q in ranks:
        assert_equal(everyone[q], mine, f"replica of rank {q}")
    sub = comm.Split(r % 2, key=r)
    assert_same_on_all_ranks(sub, mine, "set replicas")
    sub.Free()
