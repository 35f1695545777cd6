"""join(): ranks with fewer steps join early; the others' reductions complete over the ranks
still active (Average divides by them), on every algorithm, riding in the agreement or not;
other collectives raise on every rank; DistributedOptimizer ends with identical replicas."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from collectives.optim import DistributedOptimizer, broadcast_parameters
from conftest import (
    FLOAT32_TRAINING,
    assert_equal,
    assert_same_on_all_ranks,
    cast_like,
    make_input,
    reference_reduce,
    rounding_bound,
    skip_unrunnable,
)

import collectives as C
import collectives.horovod as hvd
from collectives.compression import Int8Compressor


def _steps(r: int) -> int:
    """Rank r makes this many calls before joining: every rank a different number."""
    return 1 + r


def _active(step: int, n: int) -> list[int]:
    return [q for q in range(n) if _steps(q) > step]


@pytest.mark.parametrize("algo", list(C.ALGORITHMS))
@pytest.mark.parametrize("count", [0, 1, 5, 3000, 70000])
def test_uneven_allreduces_then_join(comm, algo, count):
    r, n = comm.Get_rank(), comm.Get_size()
    skip_unrunnable(algo)
    for step in range(_steps(r)):
        active = _active(step, n)
        for op in (C.Sum, C.Average, C.Max):
            for dtype in ("float32", "int32", "bfloat16"):
                inputs = [make_input(dtype, (count,), 1000 * step + q) for q in range(n)]
                x = torch.from_numpy(inputs[r].copy()).to(getattr(torch, dtype)) \
                    if dtype == "bfloat16" else inputs[r]
                got = C.allreduce(x, op=op, algorithm=algo)
                if dtype == "bfloat16":
                    got = got.to(torch.float64).numpy()
                expected = reference_reduce([inputs[q] for q in active], op, dtype, len(active))
                if op is C.Average and dtype != "int32":
                    expected = cast_like(reference_reduce([inputs[q] for q in active], C.Sum,
                                                          "float64", 1) / len(active), dtype)
                if dtype == "bfloat16" and op is C.Average:
                    # sums of small integers are exact; the division rounds to bfloat16
                    # once here (twice by a reciprocal) and once in the reference
                    assert np.all(np.abs(got - expected)
                                  <= rounding_bound("bfloat16", 3, np.abs(expected)))
                else:
                    assert_equal(got, expected, f"step {step} {op} {dtype}")
    assert C.join() == n - 1
    assert_same_on_all_ranks(comm, C.allreduce(np.arange(5.0)), "usable after join")


def test_grouped_and_compressed_allreduce_with_joined_ranks(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    for step in range(_steps(r)):
        active = _active(step, n)
        k = float(sum(q + 1 for q in active))
        a, b = C.grouped_allreduce([np.full(3, r + 1.0), np.full((70000,), r + 1.0)], op=C.Sum)
        assert_equal(a, np.full(3, k), "grouped small")
        assert_equal(b, np.full(70000, k), "grouped large")
        for compression in (C.Compression.fp16, C.Compression.int8, C.Compression.int4,
                            Int8Compressor("two-phase"), C.Compression.topk(1.0)):
            got = C.allreduce(np.full(5000, r + 1.0, np.float32), compression=compression)
            # fp16 rounds each rank's value and n - 1 sums (2**-11 each); int8 and int4 hold
            # a constant block to float32's rounding (its value is the largest, the top
            # level); two phases quantize the sum again, alike; Top-K of every value is
            # exact, and a joined rank sends zeros
            np.testing.assert_allclose(got, k / len(active), rtol=1e-2)
        h = C.allreduce_async(torch.full((40000,), r + 1.0), op=C.Average)
        assert torch.allclose(C.synchronize(h), torch.full((40000,), k / len(active)))
    C.join()


def test_other_collectives_raise_while_some_have_joined_and_the_joined_wait_on(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    if n == 1:
        pytest.skip("needs a rank that has not joined")
    if r == 0:
        assert C.join() == n - 1  # waits through the others' errors below
    else:
        with pytest.raises(C.MismatchError, match=r"allgather: 1 of \d+ rank has joined; until "
                                                  "every rank has joined, only allreduce"):
            C.allgather(np.ones(2))
        if n > 2:  # a mismatch among the others names them, and the joined rank
            with pytest.raises(C.MismatchError, match=r"dtype mismatch.*\(rank 0 in join\(\)\)"):
                C.allreduce(np.ones(2, np.float32 if r == 1 else np.float64))
        assert_equal(C.allreduce(np.ones(2), op=C.Sum), np.full(2, n - 1.0), "still joined")
        assert C.join() == n - 1
    assert_equal(C.allreduce(np.ones(2), op=C.Sum), np.full(2, float(n)), "usable after")


def test_join_with_async_work_in_flight_raises(comm):
    """Rank 0 submits only once every other rank has called join() (told by a message on
    comm), so their async calls are still in flight then: a clear error, and the library
    stays usable."""
    r, n = comm.Get_rank(), comm.Get_size()
    if n == 1:
        pytest.skip("needs a rank to wait for")
    if r == 0:
        for peer in range(1, n):
            comm.recv(source=peer, tag=11)
    h = C.allreduce_async(np.ones(1 << 16, np.float32), op=C.Sum)
    if r != 0:
        with pytest.raises(RuntimeError, match=r"join: collectives submitted before it are "
                                               r"still in flight .* synchronize\(\) them"):
            C.join()
        comm.send(None, dest=0, tag=11)
    assert_equal(C.synchronize(h), np.full(1 << 16, float(n), np.float32), "async result")
    assert len(set(comm.allgather(C.join()))) == 1  # every rank can join now


def test_join_with_nothing_left_returns_a_rank(comm):
    last = C.join()
    assert 0 <= last < comm.Get_size()
    assert len(set(comm.allgather(last))) == 1


@pytest.mark.parametrize("make", ["active", "predivided", "initial", "horovod"])
def test_distributed_optimizer_with_uneven_batches(comm, make):
    """Rank r trains on 2 + r batches, then joins; the last rank to join has the replica
    a single process computes (each step averaging the gradients of the ranks still
    active, with or without a gradient_predivide_factor; or, over the initial size, with
    divide_by_initial_world_size and in Horovod's optimizer, summing them over n); after
    broadcasting from it, every replica is that one."""
    r, n = comm.Get_rank(), comm.Get_size()

    def batch(q: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + q)
        return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)

    def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, opt = model_and_opt()
    named = model.named_parameters()
    dist = {"active": lambda: DistributedOptimizer(opt, named_parameters=named),
            "predivided": lambda: DistributedOptimizer(opt, named_parameters=named,
                                                       gradient_predivide_factor=2.0),
            "initial": lambda: DistributedOptimizer(opt, named_parameters=named,
                                                    divide_by_initial_world_size=True),
            "horovod": lambda: hvd.DistributedOptimizer(opt, named_parameters=named)}[make]()
    for step in range(2 + r):
        dist.zero_grad()
        x, y = batch(r, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        dist.step()
    last = C.join()
    assert last == n - 1
    broadcast_parameters(model.state_dict(), root_rank=last)

    ref, ref_opt = model_and_opt()  # one process holding every rank's batches
    for step in range(2 + n - 1):
        active = [q for q in range(n) if 2 + q > step]
        grads = []
        for q in active:
            ref.zero_grad()
            x, y = batch(q, step)
            torch.nn.functional.mse_loss(ref(x), y).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            p.grad = sum(g[i] for g in grads) / (n if make in ("initial", "horovod")
                                                 else len(active))
        ref_opt.step()
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    torch.testing.assert_close(mine, expected, **FLOAT32_TRAINING)
    assert_same_on_all_ranks(comm, mine.numpy(), "replicas")
