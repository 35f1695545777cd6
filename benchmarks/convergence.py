"""A small convergence harness for data-parallel optimizers: scikit-learn's bundled data
sets (no download), a fixed model per task, and a training loop in which every rank takes its
slice of the same global batches, so an optimizer's result is comparable with Adam's and the
same on every rank. benchmarks/onebit_convergence.py (the fuller sweep over 1-bit Adam
variants), benchmarks/ddp_hooks_convergence.py and tests/mpi/test_onebit_adam.py train with
it. It needs scikit-learn, so it is no part of the installed library: the benchmarks beside
it import it as `convergence`, the test loads it from this folder by its path."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from collectives import api as C

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


def mlp(inputs: int, outputs: int) -> nn.Module:
    """One hidden layer of 128 units."""
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
    "digits": Task(_digits, mlp, epochs=15),
    "digits-cnn": Task(_digits, _cnn, epochs=8),
    "cancer": Task(_cancer, mlp, epochs=15),
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


#: make(params, lr, freeze_step) -> the optimizer to train with
MakeOptimizer = Callable[[list, float, int], torch.optim.Optimizer]


def train(task: str, make: MakeOptimizer, seed: int, lr: float, freeze_step: int = 40,
          batch: int = 64, epochs: int | None = None,
          wrap: Callable[[nn.Module], nn.Module] | None = None) -> Result:
    """Train `task`'s model with make's optimizer on every rank; the same result on every
    rank. wrap: what the model runs inside (DistributedDataParallel, which then averages
    the gradients), or None."""
    spec = TASKS[task]
    x_train, y_train, x_test, y_test = spec.data()
    torch.manual_seed(seed)
    model = spec.model(x_train.shape[1], int(y_train.max()) + 1)
    opt = make(list(model.parameters()), lr, freeze_step)
    wrapped = model if wrap is None else wrap(model)
    epochs = spec.epochs if epochs is None else epochs
    for epoch in range(epochs):
        if epoch == epochs - 1:
            sent_before = C.stats()["bytes_sent"]
        steps = _train_epoch(wrapped, opt, x_train, y_train, batch, seed * 1000 + epoch)
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
