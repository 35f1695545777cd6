"""collectives.horovod: Horovod's torch API (names, signatures, defaults, semantics, errors),
its differentiable collectives, Adasum against a NumPy reference of its formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_same_on_all_ranks

import collectives as C
import collectives.horovod as hvd


def test_the_job_and_what_is_built(comm):
    hvd.init()
    assert hvd.is_initialized()
    assert (hvd.size(), hvd.rank()) == (comm.Get_size(), comm.Get_rank())
    assert hvd.local_size() * hvd.cross_size() >= hvd.size() and 0 <= hvd.local_rank()
    assert hvd.mpi_built() and hvd.mpi_enabled() and isinstance(hvd.mpi_threads_supported(), bool)
    assert not (hvd.gloo_built() or hvd.gloo_enabled() or hvd.ddl_built() or hvd.ccl_built()
                or hvd.cuda_built() or hvd.rocm_built()) and hvd.nccl_built() == 0
    assert isinstance(hvd.is_homogeneous(), bool)


def test_shutdown_then_init_again(comm):
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init()
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [comm.Get_size()] * 2


def test_allreduce_average_and_op(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    x = torch.full((3,), float(r))
    mean = sum(range(n)) / n
    assert torch.allclose(hvd.allreduce(x), torch.full((3,), mean))
    assert torch.equal(hvd.allreduce(x, average=False), torch.full((3,), float(sum(range(n)))))
    assert torch.equal(hvd.allreduce(x, op=hvd.Max), torch.full((3,), float(n - 1)))
    with pytest.raises(ValueError, match="op parameter supersedes average"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert torch.equal(scaled, torch.full((3,), float(sum(range(n)))))
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y and y[0] == sum(range(n))
    h = hvd.allreduce_async(x, name="a")
    assert torch.allclose(hvd.synchronize(h), torch.full((3,), mean))
    h = hvd.allreduce_async_(y, op=hvd.Min, name="a")  # the name is free again
    hvd.synchronize(h)
    assert hvd.poll(h)
    a, b = hvd.grouped_allreduce([x, 2 * x], average=False)
    assert b[0] == 2 * sum(range(n))


def test_a_name_in_flight_cannot_be_reused(comm):
    """A name is taken until the caller has seen its call finish: synchronize() or a poll()
    that returns True."""
    big = torch.ones(1 << 18)
    first = hvd.allreduce_async(big, name="grad.w")
    with pytest.raises(ValueError, match="same name as another tensor"):
        hvd.allreduce_async(big, name="grad.w")
    hvd.synchronize(first)
    second = hvd.allreduce_async(big, name="grad.w")
    while not hvd.poll(second):
        pass
    hvd.synchronize(hvd.allreduce_async(big, name="grad.w"))


def test_mismatches_raise_runtime_errors_as_horovods_do(comm):
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    shape = (3,) if comm.Get_rank() == 0 else (4,)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        hvd.allreduce(torch.ones(shape))
    with pytest.raises(RuntimeError):
        hvd.broadcast(torch.ones(2), root_rank=comm.Get_rank())


def _ones_grad(out: torch.Tensor) -> None:
    out.backward(torch.ones_like(out))


def test_gradients(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    x = torch.arange(4.0, requires_grad=True)
    _ones_grad(hvd.allreduce(x, op=hvd.Sum))
    assert torch.equal(x.grad, torch.full((4,), float(n)))
    x.grad = None
    _ones_grad(hvd.allreduce(x))
    assert torch.allclose(x.grad, torch.ones(4))
    # Horovod's convention from here: the gradients of allgather, broadcast and
    # reducescatter are averaged over the ranks
    g = torch.ones(r + 1, 2, requires_grad=True)
    _ones_grad(hvd.allgather(g))
    assert torch.equal(g.grad, torch.ones(r + 1, 2))
    b = torch.ones(3, requires_grad=True)
    _ones_grad(hvd.broadcast(b, root_rank=0))
    assert torch.equal(b.grad, torch.full((3,), 1.0 if r == 0 else 0.0))
    t = torch.arange(2.0 * n, requires_grad=True)
    out, got = hvd.alltoall(t, splits=[2] * n)
    (out * (r + 1)).sum().backward()  # row j of rank r went to rank j
    assert torch.equal(t.grad, torch.repeat_interleave(torch.arange(1.0, n + 1), 2))
    assert got.tolist() == [2] * n
    s = torch.ones(2 * n, 3, requires_grad=True)
    _ones_grad(hvd.reducescatter(s, op=hvd.Sum))
    assert torch.equal(s.grad, torch.full((2 * n, 3), float(n)))
    parts = [torch.ones(r + 1, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
    sum(o.sum() for o in hvd.grouped_allgather(parts)).backward()
    assert torch.equal(parts[0].grad, torch.ones(r + 1))
    rs = [torch.ones(n, requires_grad=True)]
    hvd.grouped_reducescatter(rs, op=hvd.Average)[0].sum().backward()
    assert torch.equal(rs[0].grad, torch.ones(n))
    gs = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    sum(o.sum() for o in hvd.grouped_allreduce(gs, op=hvd.Sum)).backward()
    assert torch.equal(gs[1].grad, torch.full((3,), float(n)))


def test_the_rest_of_the_api(comm, tmp_path):
    r, n = comm.Get_rank(), comm.Get_size()
    hvd.barrier()
    assert hvd.allgather_object({"r": r}) == [{"r": q} for q in range(n)]
    assert hvd.broadcast_object("hi" if r == 0 else None, root_rank=0) == "hi"
    rows = hvd.grouped_allgather([torch.ones(r + 1), torch.zeros(1)])
    assert rows[0].shape == (n * (n + 1) // 2,) and rows[1].shape == (n,)
    part = hvd.grouped_reducescatter([torch.ones(n, 2)], op=hvd.Sum)
    assert torch.equal(part[0], torch.full((1, 2), float(n)))
    evens = hvd.add_process_set(list(range(0, n, 2)))
    if evens.included():
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=evens).item() == len(evens.ranks)
    assert hvd.remove_process_set(evens)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    assert opt.param_groups[0]["lr"] == 0.01
    dist = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(dist, step_size=1, gamma=0.5)
    for _ in range(2):
        dist.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        dist.step()
        sched.step()
    assert dist.param_groups[0]["lr"] == 0.0025
    assert_same_on_all_ranks(comm, model.weight.detach().numpy(), "replicas")
    for step in range(1 + r):  # Horovod's join: the joined ranks count as zeros in Average
        got = hvd.allreduce(torch.ones(2), name=f"uneven.{step}")
        assert torch.allclose(got, torch.full((2,), (n - step) / n))
    assert hvd.join() == n - 1


def _adasum_reference(vectors: list[np.ndarray]) -> np.ndarray:
    """Adasum's formula over the ranks as a binary tree (pairs, then pairs of pairs)."""
    level = [v.astype(np.float64) for v in vectors]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[::2], level[1::2]):
            dot, na, nb = a @ b, a @ a, b @ b
            nxt.append((1 - dot / (2 * na) if na else 1) * a + (1 - dot / (2 * nb) if nb else 1) * b)
        level = nxt
    return level[0]


def test_adasum_allreduce_matches_its_formula(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(r)
    x = rng.standard_normal(1000)
    if n & (n - 1):
        with pytest.raises(ValueError, match="power-of-two number of ranks"):
            hvd.allreduce(torch.from_numpy(x), op=hvd.Adasum)
        return
    got = hvd.allreduce(torch.from_numpy(x), op=hvd.Adasum)
    expected = _adasum_reference(comm.allgather(x))
    # float64: dot products of 1000 terms (<= 999 roundings of 2**-53 each: 1.1e-13 of
    # their terms' size) and a few scalings, in another order than the reference's
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)
    assert_same_on_all_ranks(comm, got.numpy(), "adasum")
    same = hvd.allreduce(torch.ones(4, dtype=torch.float32), op=hvd.Adasum)
    assert torch.equal(same, torch.ones(4))  # identical vectors: their average
    zero = hvd.allreduce(torch.zeros(3), op=hvd.Adasum)
    assert not zero.any()


def test_adasum_optimizer_combines_the_steps(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    if n & (n - 1):
        pytest.skip("Adasum needs a power-of-two number of ranks")
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1, bias=False)
    start = model.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    assert isinstance(opt, torch.optim.Optimizer)
    torch.manual_seed(10 + r)
    model(torch.randn(8, 5)).square().mean().backward()
    delta = (-0.1 * model.weight.grad).numpy().reshape(-1)
    opt.step()
    expected = start.numpy().reshape(-1) + _adasum_reference(comm.allgather(delta))
    # float32 (u = 2**-24): 5-term dot products and norms, scaled and added to the weight:
    # tens of roundings of the weight's size (168 u = 1e-5), of the step's near zero
    np.testing.assert_allclose(model.weight.detach().numpy().reshape(-1), expected, rtol=1e-5,
                               atol=1e-7)
    assert_same_on_all_ranks(comm, model.weight.detach().numpy(), "replicas")


def test_an_optimizer_outside_its_process_set_steps_alone(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    evens = hvd.add_process_set(list(range(0, n, 2)))
    try:
        torch.manual_seed(r)
        model = torch.nn.Linear(3, 1)
        start = model.weight.detach().clone()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       process_set=evens)
        model(torch.randn(4, 3) + r).sum().backward()
        local = model.weight.grad.clone()
        opt.step()
        if not evens.included():  # Horovod's rule: not reduced, a plain local step
            assert torch.allclose(model.weight, start - 0.1 * local)
    finally:
        hvd.remove_process_set(evens)


def test_reducescatter_refuses_adasum():
    with pytest.raises(RuntimeError, match="reducescatter does not support Adasum"):
        hvd.reducescatter(torch.ones(4), op=hvd.Adasum)


@pytest.mark.parametrize("collective", ["allreduce", "allgather", "broadcast", "reducescatter"])
def test_a_barrier_meets_beside_a_named_call_in_flight(comm, collective):
    """Rank 0 starts a named async call and meets the others at a barrier before they start
    theirs (Horovod's duplicate-name tests): the barrier is not held up by it, a second call
    of the name raises on every rank while the first is in flight, the next barrier returns
    only once the call (which every rank then started) has finished, and it is exact."""
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    if not hvd.mpi_threads_supported():
        pytest.skip("the barrier meets beside the engine only under MPI_THREAD_MULTIPLE")
    r, n = comm.Get_rank(), comm.Get_size()
    x = torch.full((17, 17, 17), float(r + 1))
    extra = {"broadcast": {"root_rank": 0}}.get(collective, {})
    start = getattr(hvd, f"{collective}_async")
    name = f"duplicate_name.{collective}"

    def start_twice():
        handle = start(x, name=name, **extra)
        with pytest.raises(ValueError, match="same name as another tensor"):
            start(x, name=name, **extra)
        return handle

    if r == 0:
        handle = start_twice()
        assert not hvd.poll(handle)  # the others start it only after the barrier
    hvd.barrier()
    if r > 0:
        handle = start_twice()
    hvd.barrier()
    assert hvd.poll(handle)
    got = hvd.synchronize(handle)
    want = {"allreduce": x * 0 + (n + 1) / 2.0,
            "allgather": torch.cat([torch.full((17, 17, 17), float(k + 1)) for k in range(n)]),
            "broadcast": torch.ones(17, 17, 17)}.get(collective)
    if collective == "reducescatter":
        rows = [len(a) for a in np.array_split(np.arange(17), n)]
        want = torch.full((rows[r], 17, 17), (n + 1) / 2.0)
    assert torch.equal(got, want)


def test_a_barrier_frees_the_names_of_the_calls_it_waited_for(comm):
    """Horovod's duplicate-name tests one after another, as its suite runs them: each drops
    its handles unsynchronized, and the next reuses the name after a barrier. Horovod frees
    a name as its call finishes; here the barrier that waited for the call frees it. (Before,
    the second test's first call was refused on rank 0 alone, which then left while the
    others waited in the barrier.)"""
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    r = comm.Get_rank()
    x = torch.ones(17, 17)

    def start(collective):
        extra = {"broadcast": {"root_rank": 0}}.get(collective, {})
        call = getattr(hvd, f"{collective}_async")
        try:
            call(x, name="duplicate_name", **extra)  # the handle is dropped, as Horovod's tests do
        except ValueError as exc:
            return f"rank {r}: {collective}: {exc}"
        with pytest.raises(ValueError, match="same name as another tensor"):
            call(x, name="duplicate_name", **extra)
        return None

    for collective in ["allreduce", "allgather", "broadcast", "reducescatter", "allreduce"]:
        refused = start(collective) if r == 0 else None
        # every rank learns of a refusal over mpi4py, so that none waits in the barrier
        assert not [why for why in comm.allgather(refused) if why]
        hvd.barrier()
        refused = start(collective) if r > 0 else None
        assert not [why for why in comm.allgather(refused) if why]
        hvd.barrier()


def test_a_sparse_allreduce_refuses_a_name_in_flight_before_starting(comm):
    """A refused sparse allreduce starts none of its allgathers."""

    def allgathers() -> int:
        return sum(v["calls"] for k, v in C.stats()["per_op"].items()
                   if k.startswith("allgather/"))

    r, n = comm.Get_rank(), comm.Get_size()
    x = torch.sparse_coo_tensor([[r]], [1.0], (n,))
    before = allgathers()
    first = hvd.sparse_allreduce_async(x, name="embedding", op=hvd.Sum)
    with pytest.raises(ValueError, match="same name as another tensor"):
        hvd.sparse_allreduce_async(x, name="embedding", op=hvd.Sum)
    assert torch.equal(hvd.synchronize(first).to_dense(), torch.ones(n))
    hvd.allreduce(torch.ones(1))  # runs after anything still queued
    assert allgathers() == before + 2  # indices and values, once


@pytest.mark.parametrize("compression", [hvd.Compression.fp16, hvd.Compression.int8])
def test_reducescatter_compressed(comm, compression):
    """Horovod's reducescatter takes a compression: the rows are close to the uncompressed
    ones and alike on every rank; gradients still flow through it."""
    n = comm.Get_size()
    x = torch.linspace(-1, 1, 6 * n, dtype=torch.float32).reshape(2 * n, 3) * (comm.Get_rank() + 1)
    plain = hvd.reducescatter(x)
    got = hvd.reducescatter(x, compression=compression)
    # int8 holds rank q's values to 1/254 of its largest (q + 1), the average the mean of
    # those; fp16 is far closer (2**-11 of values <= n)
    bound = sum((q + 1) / 254 for q in range(n)) / n * 1.01
    assert got.shape == plain.shape and (got - plain).abs().max() <= bound
    assert_same_on_all_ranks(comm, hvd.allgather(got).numpy(), "rows")
    leaf = x.clone().requires_grad_()
    hvd.reducescatter(leaf, compression=compression).sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == x.shape
