"""What PyTorch's own distributed test suite (ci/torch_suite.py) found missing in the
"collectives" backend, each against an independent reference: all_gather_coalesced over
shapes and dtypes, sparse COO all_reduce, the group methods called without options
(torch's defaults), and the monitored barrier naming the rank that did not come. A
group's timeout is tested in tests/unit/test_failures.py (a timed-out call leaves the
process's engine refusing calls, so it runs in a job of its own)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_on_all_ranks, rounding_bound

import collectives as C


@pytest.fixture(scope="module", autouse=True)
def group():
    dist.init_process_group("collectives")
    yield dist.group.WORLD
    dist.destroy_process_group()


def _tensor(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16, torch.complex64,
                                   torch.uint8])
def test_all_gather_coalesced_shapes_and_empty(comm, dtype, async_op):
    r, n = comm.Get_rank(), comm.Get_size()
    shapes = [(3,), (2, 2), (0,), (5, 1, 1), ()]
    mine = [_tensor(dtype, s, 100 * r + i) for i, s in enumerate(shapes)]
    everyone = comm.allgather([t.numpy() for t in mine])
    outs = [[torch.full_like(t, 7) for t in mine] for _ in range(n)]
    outs[0][1] = outs[0][1].t()  # a non-contiguous output
    work = dist.all_gather_coalesced(outs, mine, async_op=async_op)
    if async_op:
        work.wait()
    for j in range(n):
        for i, out in enumerate(outs[j]):
            assert np.array_equal(out.numpy(), everyone[j][i]), (j, i)
    assert [t.shape for t in mine] == [torch.Size(s) for s in shapes]  # inputs untouched


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
def test_sparse_all_reduce_sums_every_ranks_entries(comm, dtype, async_op):
    r = comm.Get_rank()
    g = torch.Generator().manual_seed(r)
    nnz = r % 3  # rank 0 contributes nothing; duplicates across ranks and within one
    indices = torch.randint(0, 4, (2, nnz), generator=g)
    values = torch.randn(nnz, 3, generator=g).to(dtype) if dtype.is_floating_point else \
        torch.randint(-9, 9, (nnz, 3), generator=g).to(dtype)
    mine = torch.sparse_coo_tensor(indices, values, (4, 4, 3))
    dense = comm.allgather(mine.to_dense().numpy())
    work = dist.all_reduce(mine, async_op=async_op)
    if async_op:
        assert work.get_future().wait()[0] is mine
    assert mine.is_sparse
    expected = sum(dense[1:], dense[0].copy())
    got = mine.to_dense().numpy()
    if dtype.is_floating_point:  # the sum of different terms, in another order
        magnitude = sum(comm.allgather(torch.sparse_coo_tensor(indices, values.abs(), (4, 4, 3))
                                       .to_dense().numpy()))
        # each side adds at most 2 n terms (nnz <= 2 a rank), up to 4n - 2 roundings apart
        assert np.all(np.abs(got - expected) <= rounding_bound(dtype, 4 * comm.Get_size(),
                                                               magnitude))
    else:
        assert np.array_equal(got, expected)
    assert_same_on_all_ranks(comm, got, "sparse all_reduce")


def test_sparse_all_reduce_refuses_other_ops_on_every_rank(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    sparse = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.long), torch.ones(1), (2,))
    with pytest.raises(ValueError, match="op: a sparse tensor is reduced with SUM only"):
        dist.all_reduce(sparse, op=dist.ReduceOp.MAX)
    if n > 1:  # one rank's bad op: the others raise too, in the same call
        with pytest.raises(ValueError if r == 0 else C.MismatchError):
            dist.all_reduce(sparse, op=dist.ReduceOp.MAX if r == 0 else dist.ReduceOp.SUM)
    t = torch.ones(1)
    dist.all_reduce(t)  # in step
    assert t.item() == n


def test_group_methods_take_torchs_default_options(comm, group):
    n = comm.Get_size()
    t = torch.ones(3)
    result = group.allreduce([t]).get_future().then(lambda f: [x * 2 for x in f.wait()])
    assert result.wait()[0].tolist() == [2.0 * n] * 3
    b = torch.full((2,), float(comm.Get_rank()))
    group.broadcast([b]).wait()
    assert b.tolist() == [0.0, 0.0]
    group.barrier().wait()
    outs = [torch.zeros(2) for _ in range(n)]
    group.allgather([outs], [torch.full((2,), 1.0)]).wait()
    assert all(o.tolist() == [1.0, 1.0] for o in outs)


def test_monitored_barrier_passes_and_names_the_rank_that_did_not_come(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    from datetime import timedelta
    world = dist.group.WORLD
    for wait_all in (False, True):
        world.monitored_barrier(timedelta(seconds=30), wait_all_ranks=wait_all)
    if n < 3:
        return
    late = dist.new_group(list(range(n)))  # its barriers' count stays off after a failure
    if r == 0:
        with pytest.raises(RuntimeError, match="Ranks 1, 2 failed to pass monitoredBarrier"):
            late.monitored_barrier(timedelta(seconds=0.5), wait_all_ranks=True)
    elif r > 2:
        with pytest.raises(RuntimeError, match=f"Rank {r} successfully reached monitoredBarrier"):
            late.monitored_barrier(timedelta(seconds=2))
    comm.Barrier()
    if r == 0:
        with pytest.raises(RuntimeError, match="Rank 0 timed out in monitoredBarrier"):
            late.monitored_barrier(timedelta(seconds=0))
    comm.Barrier()
