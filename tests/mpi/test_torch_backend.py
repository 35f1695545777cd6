"""The "collectives" torch.distributed backend: every operation, sync and async, against
independent references (mpi4py gathers of the inputs); bad input raising on the caller's
side and MismatchError on the others, never a hang; subgroups; DDP (no_sync, unused
parameters, static graph, bucket views), ZeroRedundancyOptimizer and FSDP2 training to the
weights of one process on the global batch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import (
    DTYPES,
    FLOAT32_TRAINING,
    OPS,
    assert_equal,
    assert_same_on_all_ranks,
    make_input,
    reference_reduce,
    to_framework,
    to_numpy,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import collectives as C
from collectives.integrations import torch_backend, torch_rendezvous

TORCH_OPS = {C.Sum: dist.ReduceOp.SUM, C.Average: dist.ReduceOp.AVG, C.Min: dist.ReduceOp.MIN,
             C.Max: dist.ReduceOp.MAX, C.Product: dist.ReduceOp.PRODUCT}
SIZES = [0, 1, 5, 1000]


@pytest.fixture(scope="module", autouse=True)
def group():
    """The default group, from nothing but MPI (no MASTER_ADDR, RANK, WORLD_SIZE set)."""
    dist.init_process_group("collectives")
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_rank_and_size_come_from_mpi(comm):
    assert dist.get_backend() == "collectives"
    assert (dist.get_rank(), dist.get_world_size()) == (comm.Get_rank(), comm.Get_size())
    assert isinstance(dist.group.WORLD, torch_backend.ProcessGroup)


def test_a_rank_that_disagrees_with_mpi_raises_on_every_rank(comm):
    n = comm.Get_size()
    with pytest.raises(ValueError, match=r"world_size=\d+ \(from the world_size argument\)"):
        next(dist.rendezvous(f"env://?rank={comm.Get_rank()}&world_size={n + 1}"))
    assert torch_rendezvous._disagreement("env://?rank=3", 0, 4).startswith(
        "init_process_group: rank=3")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce(comm, dtype, op, size):
    r, n = comm.Get_rank(), comm.Get_size()
    data = make_input(dtype, (size,), seed=7 * r + size)
    expected = reference_reduce(comm.allgather(data), op, dtype, n)
    for async_op in (False, True):
        t = to_framework(data, dtype, "torch")
        work = dist.all_reduce(t, op=TORCH_OPS[op], async_op=async_op)
        if async_op:
            assert work.get_future().wait()[0] is t
            work.wait()
        assert_equal(to_numpy(t), expected, f"all_reduce {dtype} {op.name} async={async_op}")
        assert_same_on_all_ranks(comm, to_numpy(t), "all_reduce")


def test_all_reduce_coalesced_and_chained_futures(comm):
    n = comm.Get_size()
    a, b = torch.ones(3), torch.full((4,), 2.0)
    dist.all_reduce_coalesced([a, b])
    assert a.tolist() == [n] * 3 and b.tolist() == [2 * n] * 4
    fut = dist.all_reduce(torch.ones(2), async_op=True).get_future().then(
        lambda f: f.value()[0] * 10)
    assert fut.wait().tolist() == [10 * n] * 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "uint8"])
def test_gathers(comm, dtype):
    r, n = comm.Get_rank(), comm.Get_size()
    mine = make_input(dtype, (r + 1, 2), seed=r)  # all_gather: a different size per rank
    everyone = comm.allgather(mine)
    outs = [to_framework(np.zeros((j + 1, 2)), dtype, "torch") for j in range(n)]
    dist.all_gather(outs, to_framework(mine, dtype, "torch"))
    for j in range(n):
        assert_equal(to_numpy(outs[j]), to_numpy(to_framework(everyone[j], dtype, "torch")),
                     f"all_gather from {j}")
    same = make_input(dtype, (3,), seed=r)
    flat = comm.allgather(same)
    for async_op in (False, True):
        out = to_framework(np.zeros(3 * n), dtype, "torch")
        work = dist.all_gather_single(out, to_framework(same, dtype, "torch"), async_op=async_op)
        if async_op:
            work.wait()
        assert_equal(to_numpy(out), to_numpy(to_framework(np.concatenate(flat), dtype, "torch")),
                     "all_gather_single")
    root = n - 1
    gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(n)] if r == root else None
    dist.gather(torch.full((3,), float(r), dtype=torch.float64), gathered, dst=root)
    if r == root:
        assert [g[0].item() for g in gathered] == list(range(n))


@pytest.mark.parametrize("op", OPS)
def test_reduce_scatter_and_reduce(comm, op):
    r, n = comm.Get_rank(), comm.Get_size()
    data = make_input("float32", (n * 4,), seed=r)
    total = reference_reduce(comm.allgather(data), op, "float32", n)
    out = torch.zeros(4)
    dist.reduce_scatter_single(out, torch.from_numpy(data.copy()), op=TORCH_OPS[op])
    assert_equal(out.numpy(), total[4 * r:4 * r + 4], "reduce_scatter_single")
    out = torch.zeros(4)
    work = dist.reduce_scatter(out, list(torch.from_numpy(data.copy()).split(4)),
                               op=TORCH_OPS[op], async_op=True)
    work.wait()
    assert_equal(out.numpy(), total[4 * r:4 * r + 4], "reduce_scatter")
    for root in range(n):
        t = torch.from_numpy(data.copy())
        dist.reduce(t, dst=root, op=TORCH_OPS[op])
        assert_equal(t.numpy(), total if r == root else data, f"reduce to {root}")


def test_broadcast_and_scatter(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    for root in range(n):
        t = torch.full((5,), float(r))
        dist.broadcast(t, src=root)
        assert t.tolist() == [float(root)] * 5
        out = torch.zeros(2, dtype=torch.int32)
        parts = [torch.full((2,), 10 * root + j, dtype=torch.int32) for j in range(n)]
        dist.scatter(out, parts if r == root else None, src=root)
        assert out.tolist() == [10 * root + r] * 2


def test_all_to_all(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    sends = [(r + j) % 3 for j in range(n)]               # rows rank r sends to j
    receives = [(j + r) % 3 for j in range(n)]            # rows rank r gets from j
    x = torch.cat([torch.full((k, 2), 100.0 * r + j) for j, k in enumerate(sends)])
    out = torch.zeros(sum(receives), 2)
    dist.all_to_all_single(out, x, receives, sends)
    expected = torch.cat([torch.full((k, 2), 100.0 * j + r) for j, k in enumerate(receives)])
    assert torch.equal(out, expected)
    even = torch.arange(2.0 * n) + 100 * r
    out = torch.zeros(2 * n)
    dist.all_to_all_single(out, even, async_op=True).wait()
    assert out.tolist() == [100.0 * j + 2 * r + k for j in range(n) for k in range(2)]
    outs = [torch.zeros(j + 1) for j in range(n)]
    dist.all_to_all(outs, [torch.full((r + 1,), float(r)) for _ in range(n)])
    assert [o.tolist() for o in outs] == [[float(j)] * (j + 1) for j in range(n)]


def test_the_names_torch_before_2_13_calls(comm, group):
    """torch 2.12 and older call the single-tensor operations by these names (its
    all_gather_into_tensor calls _allgather_base, ...); torch's base class would raise "No
    backend type associated with device type cpu" for a group written in Python."""
    r, n = comm.Get_rank(), comm.Get_size()
    c10d = torch.distributed.distributed_c10d
    x = torch.arange(3.0) + 10 * r
    out = torch.zeros(3 * n)
    group._allgather_base(out, x, c10d.AllgatherOptions()).wait()
    assert out.tolist() == [10.0 * j + k for j in range(n) for k in range(3)]
    outs = [torch.zeros(3 * n), torch.zeros(n)]
    group.allgather_into_tensor_coalesced(outs, [x, x[:1]], c10d.AllgatherOptions()).wait()
    assert outs[0].tolist() == out.tolist() and outs[1].tolist() == out[::3].tolist()
    whole = torch.arange(2.0 * n) + r
    mine = torch.zeros(2)
    opts = c10d.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    group._reduce_scatter_base(mine, whole, opts).wait()
    assert mine.tolist() == [n * (2.0 * r + k) + n * (n - 1) / 2 for k in range(2)]
    mines = [torch.zeros(2), torch.zeros(1)]
    group.reduce_scatter_tensor_coalesced(mines, [whole, whole[:n]], opts).wait()
    assert mines[0].tolist() == mine.tolist() and mines[1].tolist() == [n * r + n * (n - 1) / 2]
    got = torch.zeros(2 * n)
    group.alltoall_base(got, torch.arange(2.0 * n) + 100 * r, [], [],
                        c10d.AllToAllOptions()).wait()
    assert got.tolist() == [100.0 * j + 2 * r + k for j in range(n) for k in range(2)]


def test_point_to_point_and_objects(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.zeros(3)
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(r)), right),
           dist.P2POp(dist.irecv, got, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert got.tolist() == [float(left)] * 3
    if n > 1:
        if r == 1:
            dist.send(torch.full((2,), 7.0), dst=0, tag=5)
        elif r == 0:
            t = torch.zeros(2)
            assert dist.recv(t, tag=5) == 1 and t.tolist() == [7.0, 7.0]  # any source
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": r})
    assert objects == [{"rank": j} for j in range(n)]
    box = [{"from": r}]
    dist.broadcast_object_list(box, src=n - 1)
    assert box == [{"from": n - 1}]
    mine = [None]
    dist.scatter_object_list(mine, [j * j for j in range(n)] if r == 0 else None, src=0)
    assert mine == [r * r]


def test_subgroups(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    evens = list(range(0, n, 2))
    group = dist.new_group(evens)
    if r in evens:
        t = torch.ones(2)
        dist.all_reduce(t, group=group)
        assert t.tolist() == [float(len(evens))] * 2
        assert dist.get_rank(group) == evens.index(r)
        assert group.group_name
    else:
        assert group == dist.GroupMember.NON_GROUP_MEMBER
    local = dist.new_group([r], use_local_synchronization=True)  # made by its member alone
    t = torch.full((2,), float(r))
    dist.all_reduce(t, group=local)
    assert t.tolist() == [float(r)] * 2
    gloo = dist.new_group(backend="gloo")  # another backend beside ours
    assert dist.get_backend(gloo) == "gloo"
    t = torch.ones(1)
    dist.all_reduce(t, group=gloo)
    dist.all_reduce(t)  # the world is in step after all that
    assert t.item() == n * n


def test_bad_input_raises_on_the_caller_and_mismatch_elsewhere(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    with pytest.raises(ValueError, match="op: the collectives backend reduces with SUM.*BAND"):
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND)
    if n == 1:
        return
    with pytest.raises(ValueError if r == 0 else C.MismatchError,
                       match="BAND" if r == 0 else "rank 0 passed an invalid argument"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND if r == 0 else dist.ReduceOp.SUM)
    outs = [torch.zeros(1) for _ in range(n + (r == n - 1))]
    with pytest.raises(ValueError if r == n - 1 else C.MismatchError,
                       match="tensor_list: expected" if r == n - 1 else "passed an invalid"):
        dist.all_gather(outs, torch.ones(1))
    splits = [1] * n if r else [2] * n  # rank 0's do not sum to its rows
    with pytest.raises(ValueError if r == 0 else C.MismatchError, match="splits"):
        dist.all_to_all_single(torch.zeros(n), torch.zeros(n), None, splits)
    with pytest.raises(TypeError, match="dtype"):
        dist.all_reduce(torch.ones(2, dtype=torch.bool))
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank in step
    assert t.item() == n


def _global_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4 * n, 8, generator=g), torch.randn(4 * n, 3, generator=g)


class _Net(torch.nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
        if unused:  # a layer forward never calls
            self.unused = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("options", [
    {}, {"find_unused_parameters": True}, {"static_graph": True},
    {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001}, {"no_sync": True}])
def test_ddp_trains_to_the_weights_of_one_process(comm, options):
    r, n = comm.Get_rank(), comm.Get_size()
    options = dict(options)
    no_sync = options.pop("no_sync", False)
    torch.manual_seed(0)
    model = _Net(unused=options.get("find_unused_parameters") or options.get("static_graph"))
    ref = copy.deepcopy(model)
    ddp = DDP(model, **options)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ddp, ref))
    for step in range(4):
        x, y = _global_batch(step, n)
        mine = slice(4 * r, 4 * r + 4)
        opt.zero_grad()
        if no_sync:  # two micro-batches, the first without communication
            with ddp.no_sync():
                (torch.nn.functional.mse_loss(ddp(x[mine][:2]), y[mine][:2]) / 2).backward()
            (torch.nn.functional.mse_loss(ddp(x[mine][2:]), y[mine][2:]) / 2).backward()
        else:
            torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        if no_sync:
            for half in (slice(0, 2), slice(2, 4)):
                rows = torch.cat([torch.arange(4 * j, 4 * j + 4)[half] for j in range(n)])
                (torch.nn.functional.mse_loss(ref(x[rows]), y[rows]) / 2).backward()
        else:
            torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        # float32: FLOAT32_TRAINING's budget (4 steps of 16-feature layers on <= 16 rows)
        torch.testing.assert_close(p, q, **FLOAT32_TRAINING)
        assert_same_on_all_ranks(comm, p.detach().numpy(), "DDP weights")


def test_zero_redundancy_optimizer_and_fsdp2(comm):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    r, n = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(0)
    zero_model, fsdp_model = _Net(unused=True), _Net()
    refs = [copy.deepcopy(zero_model), copy.deepcopy(fsdp_model)]
    ddp = DDP(zero_model, find_unused_parameters=True)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    fully_shard(fsdp_model.a)
    fully_shard(fsdp_model)
    sgd = torch.optim.SGD(fsdp_model.parameters(), lr=0.1)
    ref_opts = [torch.optim.Adam(refs[0].parameters(), lr=0.01),
                torch.optim.SGD(refs[1].parameters(), lr=0.1)]
    for step in range(3):
        x, y = _global_batch(step, n)
        mine = slice(4 * r, 4 * r + 4)
        for model, opt in ((ddp, zero), (fsdp_model, sgd)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
        for ref, opt in zip(refs, ref_opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            opt.step()
    for p, q in zip(zero_model.parameters(), refs[0].parameters()):
        torch.testing.assert_close(p, q, **FLOAT32_TRAINING)
    for p, q in zip(fsdp_model.parameters(), refs[1].parameters()):
        torch.testing.assert_close(p.full_tensor(), q, **FLOAT32_TRAINING)
