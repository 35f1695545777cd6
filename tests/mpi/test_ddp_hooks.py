"""DDP communication hooks (fp16, int8, int4, 1-bit, Top-K) on our backend and on gloo: the same bits as
the library's own compressed calls, warm-up, DDP training, bitwise resume from a checkpoint."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_on_all_ranks, rounding_bound
from torch.nn.parallel import DistributedDataParallel as DDP

import collectives as C
from collectives.algorithms.onebit import error_sizes
from collectives.compression import Int4Compressor, Int8Compressor
from collectives.integrations.ddp_hooks import (
    OnebitHookState,
    TopKHookState,
    fp16_hook,
    int4_hook,
    int8_hook,
    onebit_hook,
    topk_hook,
)


@pytest.fixture(scope="module", autouse=True, params=["collectives", "gloo"])
def backend(request):
    dist.init_process_group(request.param)
    yield request.param
    dist.destroy_process_group()


class _Bucket:
    """What a hook reads of DDP's GradBucket."""

    def __init__(self, buffer: torch.Tensor, index: int = 0, last: bool = True):
        self._buffer, self._index, self._last = buffer, index, last

    def parameters(self) -> list[torch.Tensor]:
        return [self._buffer]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def _grads(comm, size: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + comm.Get_rank())
    return torch.randn(size, generator=g)


@pytest.mark.parametrize("size", [1, 7, 1000, 40000])
def test_fp16_int8_and_int4_average_as_the_library_does(comm, backend, size):
    n = comm.Get_size()
    x = _grads(comm, size, 0)
    parts = comm.allgather(x.double().numpy())
    exact = sum(parts) / n
    half = fp16_hook(None, _Bucket(x.clone())).wait()
    # fp16 roundings: each rank's gradient, n - 1 additions, the division by n
    bound = rounding_bound("float16", n + 1, sum(np.abs(p) for p in parts) / n)
    assert np.all(np.abs(half.numpy() - exact) <= bound)
    assert_same_on_all_ranks(comm, half.numpy(), "fp16_hook")
    for hook, codec, maker in ((int8_hook, "int8", Int8Compressor),
                               (int4_hook, "int4", Int4Compressor)):
        got = hook(None, _Bucket(x.clone())).wait()
        # ours: the library's call, in `auto`'s form; gloo: the allgather form
        like = getattr(C.Compression, codec) if backend == "collectives" else maker("allgather")
        assert torch.equal(got, C.allreduce(x, C.Average, compression=like)), codec
        assert_same_on_all_ranks(comm, got.numpy(), hook.__name__)


@pytest.mark.parametrize("size", [1, 7, 1000])
def test_topk_is_the_librarys_topk_with_a_residual_per_bucket(comm, size):
    """Two buckets over three steps: each bucket's average is the library's Top-K call on a
    compressor of its own (the same residual carried), on either backend; a state loaded
    from state_dict() goes on with the same residuals."""
    state = TopKHookState(ratio=0.3)
    library = {0: C.Compression.topk(0.3), 1: C.Compression.topk(0.3)}
    for step in range(3):
        if step == 2:
            saved = io.BytesIO()
            torch.save(state.state_dict(), saved)
            state = TopKHookState(ratio=0.3)
            state.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=False))
        for index in (0, 1):
            x = _grads(comm, size + index, 10 * step + index)
            got = topk_hook(state, _Bucket(x.clone(), index, last=index == 1)).wait()
            expected = C.allreduce(x, C.Average, compression=library[index])
            assert torch.equal(got, expected), (step, index)
            assert_same_on_all_ranks(comm, got.numpy(), "topk_hook")


@pytest.mark.parametrize("block_size", [None, 64])
@pytest.mark.parametrize("size", [1, 7, 1000])
def test_onebit_is_compressed_allreduce_with_error_feedback_after_warmup(comm, size, block_size):
    n = comm.Get_size()
    state = OnebitHookState(warmup_steps=2, block_size=block_size)
    worker, server = (np.zeros(k, np.float32) for k in error_sizes(size, n))
    for step in range(5):
        x = _grads(comm, size, step)
        got = onebit_hook(state, _Bucket(x.clone())).wait()
        if step < 2:  # warm-up: the plain average (float32: n - 1 additions, a division)
            parts = comm.allgather(x.double().numpy())
            bound = rounding_bound("float32", n, sum(np.abs(p) for p in parts) / n)
            assert np.all(np.abs(got.numpy() - sum(parts) / n) <= bound)
        else:
            expected = C.compressed_allreduce(x, worker, server, block_size)
            assert torch.equal(got, expected), f"step {step}"
            assert np.array_equal(state.errors[0][1], worker)
        assert_same_on_all_ranks(comm, got.numpy(), "onebit_hook")
    assert state.step == 5


def _calls() -> dict[str, int]:
    """This job's calls so far per collective (per_op names them collective/algorithm)."""
    calls: dict[str, int] = {}
    for name, op in C.stats()["per_op"].items():
        collective = name.split("/")[0]
        calls[collective] = calls.get(collective, 0) + op["calls"]
    return calls


def test_on_our_backend_a_bucket_is_one_call_of_the_library(backend):
    """On the "collectives" backend (its default group included) each hook averages a
    bucket with one async call of ours, not with the exchange other backends go through."""
    if backend != "collectives":
        pytest.skip("our backend's path")
    state = OnebitHookState(warmup_steps=1)
    for hook, hook_state, collective in [(fp16_hook, None, "allreduce"),
                                         (int8_hook, None, "allreduce"),
                                         (int4_hook, None, "allreduce"),
                                         (topk_hook, TopKHookState(), "allreduce"),
                                         (onebit_hook, state, "allreduce"),  # its warm-up
                                         (onebit_hook, state, "compressed_allreduce")]:
        before = _calls()
        hook(hook_state, _Bucket(torch.ones(1000))).wait()
        added = {k: n - before.get(k, 0) for k, n in _calls().items() if n != before.get(k, 0)}
        assert added == {collective: 1}, (hook.__name__, added)


def test_bad_state_is_refused():
    with pytest.raises(TypeError, match="state: expected an OnebitHookState"):
        onebit_hook(None, _Bucket(torch.ones(3)))
    with pytest.raises(ValueError, match="warmup_steps"):
        OnebitHookState(warmup_steps=-1)
    with pytest.raises(ValueError, match="block_size"):
        OnebitHookState(block_size=0)
    with pytest.raises(TypeError, match="state: expected a TopKHookState"):
        topk_hook(None, _Bucket(torch.ones(3)))
    with pytest.raises(ValueError, match="ratio"):
        TopKHookState(ratio=0)


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8 * n, 16, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True)  # a learnable target


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _train(comm, ddp, opt, steps: range) -> float:
    r, n = comm.Get_rank(), comm.Get_size()
    for step in steps:
        x, y = _batch(step, n)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x[8 * r:8 * r + 8]), y[8 * r:8 * r + 8])
        loss.backward()
        opt.step()
    return loss.item()


@pytest.mark.parametrize("hook", ["fp16", "int8", "onebit", "topk"])
def test_ddp_trains_with_each_hook(comm, hook):
    plain = DDP(_model())
    hooked = DDP(_model(), bucket_cap_mb=0.001)  # several buckets
    if hook == "onebit":
        hooked.register_comm_hook(OnebitHookState(warmup_steps=3), onebit_hook)
    elif hook == "topk":
        hooked.register_comm_hook(TopKHookState(ratio=0.1), topk_hook)
    else:
        hooked.register_comm_hook(None, fp16_hook if hook == "fp16" else int8_hook)
    losses = []
    for ddp in (plain, hooked):
        opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
        first = _train(comm, ddp, opt, range(1))
        losses.append((first, _train(comm, ddp, opt, range(1, 60))))
        for p in ddp.parameters():
            assert_same_on_all_ranks(comm, p.detach().numpy(), f"{hook} weights")
    (plain_first, plain_last), (first, last) = losses
    assert last < 0.3 * first, losses
    assert last < plain_last + 0.1 * plain_first, losses


def test_onebit_resumes_bit_for_bit_from_a_checkpoint(comm):
    def fresh():  # DDP keeps its first bucket layout: see OnebitHookState
        ddp = DDP(_model(), find_unused_parameters=True)
        state = OnebitHookState(warmup_steps=2, block_size=32)
        ddp.register_comm_hook(state, onebit_hook)
        return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-3), state

    ddp, opt, _ = fresh()
    _train(comm, ddp, opt, range(8))
    straight = [p.detach().clone() for p in ddp.parameters()]

    ddp, opt, state = fresh()
    _train(comm, ddp, opt, range(4))
    saved = io.BytesIO()
    torch.save({"model": ddp.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()},
               saved)
    saved.seek(0)
    checkpoint = torch.load(saved)
    ddp, opt, state = fresh()
    ddp.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    state.load_state_dict(checkpoint["hook"])
    _train(comm, ddp, opt, range(4, 8))
    for p, q in zip(ddp.parameters(), straight):
        assert torch.equal(p, q)
    assert state.step == 8
