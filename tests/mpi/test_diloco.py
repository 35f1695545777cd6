"""DiLoCo: every schedule (sync_every, fragments, overlap) against a float64 one-process
replay of the same inner and outer steps on every rank's data; with sync_every=1 it is
synchronous data parallelism with the outer SGD; the shared copy bit-identical on every
rank, also under int8 with error feedback; state_dict mid-flight resumes to the same bits."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from collectives.optim import DiLoCo
from conftest import assert_same_on_all_ranks
from test_optimizer import FLOAT64_TRAINING
from torch import nn

import collectives as C

pytestmark = pytest.mark.mpi

STEPS = 12


def _model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.Tanh(),
                         nn.Linear(3, 2)).double()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(5, 4, generator=g, dtype=torch.float64),
            torch.randn(5, 2, generator=g, dtype=torch.float64))


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return nn.functional.mse_loss(model(x), y)


def _inner(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _train(model: nn.Module, opt: DiLoCo, steps: range) -> None:
    for step in steps:
        _loss(model, step, C.rank()).backward()
        opt.step()
        opt.zero_grad()


def _replay(n: int, sync_every: int, fragments: list[list[int]], overlap: bool) -> list:
    """Every rank's parameters after STEPS steps, in float64 on one process: each rank's
    model and inner SGD, the anchor stepped by Nesterov SGD (0.7, 0.9) on the ranks' mean
    change, one fragment every sync_every / len(fragments) steps, applied there or, with
    overlap, at the next point (each rank keeping its change since it sent)."""
    models = [_model() for _ in range(n)]
    inners = [_inner(m.parameters()) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    interval = sync_every // len(fragments)
    pending = None

    def apply(f, average, sent):
        for i, a in enumerate(anchor):
            a.grad = average[i] if i in fragments[f] else None
        outer.step()
        for r, m in enumerate(models):
            ps = list(m.parameters())
            with torch.no_grad():
                for i in fragments[f]:
                    drift = ps[i] - sent[r][i] if sent is not None else 0
                    ps[i].copy_(anchor[i] + drift)

    for step in range(STEPS):
        for r, (m, o) in enumerate(zip(models, inners, strict=True)):
            _loss(m, step, r).backward()
            o.step()
            o.zero_grad()
        if (step + 1) % interval:
            continue
        f = (step + 1) // interval - 1
        f %= len(fragments)
        if pending is not None:
            apply(*pending)
            pending = None
        average = {i: sum(anchor[i] - list(m.parameters())[i].detach() for m in models) / n
                   for i in fragments[f]}
        sent = [{i: p.detach().clone() for i, p in enumerate(m.parameters())} for m in models]
        if overlap:
            pending = (f, average, sent)
        else:
            apply(f, average, None)
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy()
            for m in models]


def _flat(tensors) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()


@pytest.mark.parametrize("sync_every,fragments,overlap", [
    (1, 1, False),  # synchronous data parallelism, the outer SGD on the averaged change
    (3, 1, False), (4, 2, False), (6, 3, False), (2, 1, True), (4, 2, True)])
def test_matches_the_float64_replay(comm, sync_every, fragments, overlap):
    model = _model()
    opt = DiLoCo(model, _inner(model.parameters()), sync_every=sync_every,
                 fragments=fragments, overlap=overlap)
    _train(model, opt, range(STEPS))
    expected = _replay(comm.Get_size(), sync_every, opt.fragments, overlap)
    mine = _flat(model.parameters())
    assert np.abs(mine - expected[comm.Get_rank()]).max() < FLOAT64_TRAINING
    assert_same_on_all_ranks(comm, _flat(opt.anchor), "anchor")
    if not overlap and STEPS % sync_every == 0 and fragments == 1:
        assert_same_on_all_ranks(comm, mine, "parameters just after a synchronization")


def test_use_anchor_gives_every_rank_the_shared_model(comm):
    model = _model()
    opt = DiLoCo(model, _inner(model.parameters()), sync_every=4, fragments=2)
    _train(model, opt, range(7))  # fragment 1 in flight, local steps since the last points
    opt.use_anchor()
    assert opt.pending is None
    assert np.array_equal(_flat(model.parameters()), _flat(opt.anchor))
    assert_same_on_all_ranks(comm, _flat(model.parameters()), "the shared model")


def test_synchronize_applies_the_fragment_in_flight(comm):
    model = _model()
    opt = DiLoCo(model, _inner(model.parameters()), sync_every=4, fragments=2)
    _train(model, opt, range(6))  # fragment 0 sent at step 6, in flight
    before = _flat(opt.anchor)
    opt.synchronize()  # outside no_grad, as a training loop calls it
    assert opt.pending is None and not np.array_equal(_flat(opt.anchor), before)
    assert_same_on_all_ranks(comm, _flat(opt.anchor), "anchor")


def test_int8_with_error_feedback_keeps_the_anchor_identical(comm):
    model, plain = _model(), _model()
    opt = DiLoCo(model, _inner(model.parameters()), sync_every=3,
                 compression=C.Compression.int8)
    ref = DiLoCo(plain, _inner(plain.parameters()), sync_every=3)
    _train(model, opt, range(STEPS))
    _train(plain, ref, range(STEPS))
    assert_same_on_all_ranks(comm, _flat(opt.anchor), "int8 anchor")
    gap = np.abs(_flat(opt.anchor) - _flat(ref.anchor)).max()
    assert 0 < gap < 0.05, gap  # quantized, and close to the uncompressed run
    if comm.Get_size() > 1:
        assert any(e.abs().max() > 0 for e in opt.errors)


def test_state_dict_in_flight_resumes_to_the_same_bits(comm):
    model = _model()
    opt = DiLoCo(model, _inner(model.parameters()), sync_every=4, fragments=2)
    _train(model, opt, range(6))  # a fragment in flight
    assert opt.pending is not None
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, range(6, STEPS))
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    again = _model()
    again.load_state_dict(saved["model"])
    resumed = DiLoCo(again, _inner(again.parameters()), sync_every=4, fragments=2)
    resumed.load_state_dict(saved["opt"])
    _train(again, resumed, range(6, STEPS))
    assert np.array_equal(_flat(again.parameters()), _flat(model.parameters()))
    assert np.array_equal(_flat(resumed.anchor), _flat(opt.anchor))


def test_bad_arguments_raise():
    model = _model()
    inner = _inner(model.parameters())
    with pytest.raises(ValueError, match="sync_every"):
        DiLoCo(model, inner, sync_every=0)
    with pytest.raises(ValueError, match="sync_every: expected a multiple"):
        DiLoCo(model, inner, sync_every=5, fragments=2)
    with pytest.raises(ValueError, match="fragments: expected at most"):
        DiLoCo(model, inner, sync_every=12, fragments=12)
    with pytest.raises(ValueError, match="compression"):
        DiLoCo(model, inner, compression="int8")
    with pytest.raises(ValueError, match="outer_optimizer"):
        DiLoCo(model, inner, outer_optimizer=torch.optim.SGD(_model().parameters(), lr=1))
    with pytest.raises(TypeError, match="model"):
        DiLoCo(inner, inner)
