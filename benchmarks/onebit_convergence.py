"""1-bit Adam against Adam on real data (scikit-learn's bundled sets, no download): test
accuracy over seeds x learning rates for Adam and 1-bit Adam variants, and bytes per step.

    mpirun -np 2 python benchmarks/onebit_convergence.py                  # the full sweep
    mpirun -np 2 python benchmarks/onebit_convergence.py --tasks digits --seeds 0 \\
        --lrs 1e-3 --variants adam,ours

Every variant trains the same model from the same initialization on the same global
batches (each cut into one slice per rank); Adam's gradients are averaged by
DistributedOptimizer, 1-bit Adam does its own communication and switches to compressed
momentum after --freeze-step steps. Rank 0 prints one row per variant: accuracy per
(learning rate, seed), the worst shortfall against Adam over the same runs, whether any
run went non-finite, and the bytes sent per step after the freeze against a float32 ring
allreduce of the gradients (from C.stats()). Replicas are checked to be bit-identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import collectives as C
from optim import DistributedOptimizer
from optim.onebit_adam import OnebitAdam

Data = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------------- tasks

def _split(x: np.ndarray, y: np.ndarray, standardize: bool) -> Data:
    """The same stratified 75/25 split on every rank, as float32 tensors."""
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0,
                                                        stratify=y)
    if standardize:
        mean, std = x_train.mean(0), x_train.std(0)
        x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return as_x(x_train), torch.tensor(y_train), as_x(x_test), torch.tensor(y_test)


def _digits() -> Data:
    """8x8 digit images in [0, 1]: several border pixels are blank in (nearly) every image,
    so their first-layer weights see (nearly) no gradient: the frozen-variance hazard."""
    digits = load_digits()
    return _split(digits.data / 16.0, digits.target, standardize=False)


def _cancer() -> Data:
    """30 standardized tabular features, two classes."""
    cancer = load_breast_cancer()
    return _split(cancer.data, cancer.target, standardize=True)


def _mlp(inputs: int, outputs: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, 128), nn.ReLU(), nn.Linear(128, outputs))


def _cnn(inputs: int, outputs: int) -> nn.Module:
    """examples/train.py's model, on the digits as 1x8x8 images."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, outputs),
    )


@dataclasses.dataclass(frozen=True)
class Task:
    data: Callable[[], Data]
    model: Callable[[int, int], nn.Module]
    epochs: int


TASKS = {
    "digits": Task(_digits, _mlp, epochs=15),
    "digits-cnn": Task(_digits, _cnn, epochs=8),
    "cancer": Task(_cancer, _mlp, epochs=15),
}


# -------------------------------------------------------------------------------- variants

class MaskedOnebitAdam(OnebitAdam):
    """DeepSpeed's own answer, automated: its exp_avg_mask, set to zero where the frozen
    variance is exactly zero (coordinates that never saw a gradient)."""

    def _average_momentum(self, group, p, state) -> None:
        super()._average_momentum(group, p, state)
        state["exp_avg"].mul_(state["exp_avg_sq"] > 0)


class ExactOnebitAdam(OnebitAdam):
    """The ablation: 1-bit Adam's frozen variance with the momentum averaged exactly, to
    tell what freezing costs from what the one bit costs."""

    def _average_momentum(self, group, p, state) -> None:
        state["exp_avg"].lerp_(p.grad, 1 - group["betas"][0])
        C.allreduce_(state["exp_avg"], op=C.Average, algorithm="ring")


def _adam(params: list, lr: float, freeze_step: int) -> DistributedOptimizer:
    # ring: our own algorithm, so C.stats() counts its bytes (the MPI library's are hidden)
    return DistributedOptimizer(torch.optim.Adam(params, lr=lr), algorithm="ring")


def _onebit(block_size: int | None, bias_correction: bool, max_update: float | None,
            cls: type = OnebitAdam) -> Callable:
    def make(params: list, lr: float, freeze_step: int) -> OnebitAdam:
        return cls(params, lr=lr, freeze_step=freeze_step, block_size=block_size,
                   bias_correction=bias_correction, max_update=max_update)
    return make


#: name -> make(params, lr, freeze_step)
VARIANTS = {
    "adam": _adam,
    "deepspeed": _onebit(None, False, math.inf),
    "ds+bc": _onebit(None, True, math.inf),  # + bias correction
    "ds+bc+mask": _onebit(None, True, math.inf, MaskedOnebitAdam),
    "ds+bc+b256": _onebit(256, True, math.inf),  # + a scale per 256 elements
    "ds+bc+bound": _onebit(None, True, None),  # + Adam's bound on |update|
    "frozen-v": _onebit(None, True, math.inf, ExactOnebitAdam),  # no compression at all
    "frozen-v+bound": _onebit(None, True, None, ExactOnebitAdam),
    "ours": _onebit(256, True, None),  # OnebitAdam's defaults
    "ours-bound1": _onebit(256, True, 1.0),
    "ours-b64": _onebit(64, True, None),
    "ours-no-bc": _onebit(256, False, None),
}


# -------------------------------------------------------------------------------- training

@dataclasses.dataclass
class Result:
    accuracy: float  # percent, on the test split
    finite: bool
    digest: str  # of the final parameters, to compare replicas
    bytes_per_step: float  # sent by this rank per step in the last epoch


def my_slice(count: int) -> slice:
    r, n = C.rank(), C.size()
    return slice(r * count // n, (r + 1) * count // n)


def _train_epoch(model: nn.Module, opt, x: torch.Tensor, y: torch.Tensor, batch: int,
                 seed: int) -> int:
    """One pass in global batches of `batch`; returns the number of steps."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    batches = order.split(batch)
    for rows in batches:
        mine = rows[my_slice(len(rows))]
        loss = F.cross_entropy(model(x[mine]), y[mine], reduction="sum")
        # averaged over ranks, this is the mean loss of the global batch
        (loss * C.size() / len(rows)).backward()
        opt.step()
        opt.zero_grad()
    return len(batches)


def _digest(model: nn.Module) -> str:
    raw = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    return hashlib.sha256(raw).hexdigest()


def train(task: str, variant: str, seed: int, lr: float, freeze_step: int = 40,
          batch: int = 64, epochs: int | None = None) -> Result:
    """Train `task`'s model with `variant` on every rank; the same result on every rank."""
    spec = TASKS[task]
    x_train, y_train, x_test, y_test = spec.data()
    torch.manual_seed(seed)
    model = spec.model(x_train.shape[1], int(y_train.max()) + 1)
    opt = VARIANTS[variant](list(model.parameters()), lr, freeze_step)
    epochs = spec.epochs if epochs is None else epochs
    for epoch in range(epochs):
        if epoch == epochs - 1:
            sent_before = C.stats()["bytes_sent"]
        steps = _train_epoch(model, opt, x_train, y_train, batch, seed * 1000 + epoch)
    sent = C.stats()["bytes_sent"] - sent_before
    with torch.no_grad():
        model.eval()
        accuracy = (model(x_test).argmax(1) == y_test).double().mean().item() * 100
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    return Result(accuracy, bool(finite), _digest(model), sent / steps)


def ring_bytes(model_params: int) -> float:
    """Bytes a float32 ring allreduce of every gradient sends per rank."""
    n = C.size()
    return 2 * (n - 1) / n * 4 * model_params


# ---------------------------------------------------------------------------------- report

def _sweep(task: str, variants: list[str], seeds: list[int], lrs: list[float],
           freeze_step: int) -> dict[str, list[Result]]:
    results = {}
    for variant in variants:
        results[variant] = [train(task, variant, seed, lr, freeze_step)
                            for lr in lrs for seed in seeds]
        digests = C.allgather(np.array([[int(r.digest[:15], 16) for r in results[variant]]]))
        assert (digests == digests[0]).all(), f"{task}/{variant}: replicas differ"
    return results


def _row(name: str, runs: list[Result], adam: list[Result] | None, ring: float) -> str:
    accs = " ".join(f"{r.accuracy:8.1f}" if r.finite else f"{'nan':>8s}" for r in runs)
    gap = "" if adam is None else f"{max(a.accuracy - r.accuracy for a, r in zip(adam, runs)):+6.1f}"
    sent = runs[-1].bytes_per_step
    ratio = f"1/{ring / sent:5.1f}" if sent else "-"
    return f"{name:18s} {accs}  {gap:>6s}  {sent:9.0f}  {ratio}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lrs", default="1e-3,2e-3,3e-3")
    p.add_argument("--freeze-step", type=int, default=40)
    args = p.parse_args()
    C.init()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    lrs = [float(v) for v in args.lrs.split(",")]
    variants = args.variants.split(",")
    for task in args.tasks.split(","):
        results = _sweep(task, variants, seeds, lrs, args.freeze_step)
        spec = TASKS[task]
        x, y = spec.data()[:2]
        params = sum(q.numel() for q in spec.model(x.shape[1], int(y.max()) + 1).parameters())
        ring = ring_bytes(params)
        if C.rank() == 0:
            runs = " ".join(f"{lr:.0e}/s{s}" for lr in lrs for s in seeds)
            print(f"\n{task}: {C.size()} ranks, freeze_step {args.freeze_step}, "
                  f"{params} parameters; test accuracy (%) per lr/seed")
            print(f"{'variant':18s} {runs}  {'worst':>6s}  {'bytes/step':>9s}  vs ring")
            for name, runs_ in results.items():
                print(_row(name, runs_, results.get("adam") if name != "adam" else None, ring),
                      flush=True)


if __name__ == "__main__":
    main()
