"""Uneven ranks at full speed: each rank's share of a fixed global batch follows its
measured speed (Balancer), and a batch sampler deals each global batch by those shares
(BalancedSampler).

With equal shares a data-parallel step takes as long as the slowest rank's compute: every
reduction waits for it. The balancer keeps the global batch at `global_batch` samples and
gives rank r a share b_r proportional to its samples per second of compute, so that every
rank's compute takes about as long.

How it measures. A rank's compute seconds are the time it spends in
`with balancer.measure(samples):`, wrapped around its forward and backward. What the rank
spends waiting for the others must stay out of that time, or every rank would measure the
slowest one's step: DistributedOptimizer, ZeroOptimizer (stages 1 and 2) and OnebitAdam
launch their reductions during backward or in `step()` and wait for them only in
`step()`, outside the block. DDP waits for its buckets at the end of backward, inside it:
register the hook through `balancer.timed(hook)`, which notes the time DDP hands over each
bucket, and the block ends at the last bucket's (the rank's compute was done then). A
common term in every rank's time (a reduction's own transfer) slows convergence to the
balance but does not move it: shares stop changing when the measured times are equal,
that is when the computes are.

How shares change. Every `every` steps, at `step()`, the ranks allgather the samples and
seconds each measured since the last change; every rank computes the same shares from the
same gathered numbers (bit-identical everywhere): the global batch in proportion to
samples per second, in whole samples, at least one a rank, the remainders to the largest
fractions (ties to the lower rank). They are adopted only when, at the measured speeds,
they would shorten the step (the slowest rank's compute) by more than `threshold` of it,
so measurement noise does not make them oscillate. Cost: one allgather of 2 doubles a
rank every `every` steps.

The update stays the global batch's. Each rank's loss is the mean over its b_r samples;
multiplied by `weight(b_r)` = size x b_r / global_batch before backward, the average over
ranks that every optimizer here takes becomes the mean over the global batch (exact for
the uncompressed paths; the compressed ones send the weighted gradients, with their error
feedback as usual).

    balancer = Balancer(global_batch=256)
    sampler = BalancedSampler(dataset, balancer, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)
    for i, (x, y) in enumerate(loader):
        with balancer.measure(len(x)):
            loss = loss_fn(model(x), y) * balancer.weight(len(x))
            loss.backward()
        opt.step(); opt.zero_grad()
        sampler.record_batch(i)
        balancer.step()
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from collectives import api as C

from .wrapped import _check_int


def _size(process_set: Any) -> int:
    return C.size() if process_set is None else process_set.size()


def _rank(process_set: Any) -> int:
    return C.rank() if process_set is None else process_set.rank()


def epoch_order(length: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """An epoch's order of range(length): a permutation drawn from (seed, epoch) when
    shuffled, the same on every rank (ElasticSampler's and BalancedSampler's)."""
    if not shuffle:
        return list(range(length))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(length, generator=g).tolist()


def equal_shares(total: int, ranks: int) -> list[int]:
    """total split over ranks, the first (total % ranks) one more (Horovod's rule)."""
    return [total // ranks + (r < total % ranks) for r in range(ranks)]


def proportional_shares(total: int, speeds: list[float]) -> list[int]:
    """total in whole parts proportional to speeds, each at least 1 (total >= len(speeds)):
    a floor of 1 each, the rest by largest remainder, ties to the lower index. A pure
    function of its arguments: the same bits wherever it runs."""
    ranks = len(speeds)
    if ranks == 0 or total < ranks:
        raise ValueError(f"total: expected at least one part per rank ({ranks}), got {total}")
    if not all(math.isfinite(s) and s > 0 for s in speeds):
        raise ValueError(f"speeds: expected finite positive numbers, got {speeds!r}")
    spare = total - ranks
    whole = sum(speeds)
    ideal = [spare * s / whole for s in speeds]
    parts = [math.floor(x) for x in ideal]
    by_remainder = sorted(range(ranks), key=lambda r: (-(ideal[r] - parts[r]), r))
    for r in by_remainder[:spare - sum(parts)]:
        parts[r] += 1
    return [1 + p for p in parts]


def step_seconds(shares: list[int], speeds: list[float]) -> float:
    """The compute time of a step with these shares at these speeds: the slowest rank's."""
    return max(b / v for b, v in zip(shares, speeds, strict=True))


def better(old: list[int], new: list[int], speeds: list[float], threshold: float) -> bool:
    """Whether new shares shorten the step by more than threshold of its time with old."""
    return step_seconds(new, speeds) < (1 - threshold) * step_seconds(old, speeds)


class Balancer:
    """Each rank's share of a global batch of `global_batch` samples (`share`, `shares`),
    re-measured every `every` steps and changed when that would shorten the step by more
    than `threshold` of it. process_set: the ranks that train together (None: the job).
    Off means not made: without a balancer every rank takes global_batch / size."""

    def __init__(self, global_batch: int, every: int = 20, threshold: float = 0.05,
                 process_set: Any = None):
        self.global_batch = _check_int("global_batch", global_batch, 1)
        self.every = _check_int("every", every, 1)
        if not (isinstance(threshold, (int, float)) and 0 <= threshold < 1):
            raise ValueError(f"threshold: expected a fraction in [0, 1), got {threshold!r}")
        self.threshold = float(threshold)
        self.process_set = process_set
        self.steps = 0  # steps since the last change
        self.shares = self._even()
        self._samples = 0
        self._seconds = 0.0
        self._posted: float | None = None  # the last DDP bucket handed to timed() hooks

    def _even(self) -> list[int]:
        size = _size(self.process_set)
        if self.global_batch < size:
            raise ValueError(f"global_batch: expected at least one sample per rank "
                             f"({size} ranks), got {self.global_batch}")
        return equal_shares(self.global_batch, size)

    @property
    def share(self) -> int:
        """This rank's samples of each global batch."""
        return self.shares[_rank(self.process_set)]

    def weight(self, samples: int) -> float:
        """The factor of a loss averaged over this rank's `samples` that makes the average
        over ranks the mean over the global batch: size x samples / global_batch."""
        return _size(self.process_set) * samples / self.global_batch

    @contextlib.contextmanager
    def measure(self, samples: int) -> Iterator[None]:
        """Time the block (this rank's forward and backward of `samples` samples) as
        compute; with timed() DDP hooks, up to the last bucket handed over in it."""
        self._posted = None
        start = time.perf_counter()
        yield
        end = time.perf_counter() if self._posted is None else self._posted
        self._samples += samples
        self._seconds += end - start

    def timed(self, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """A DDP communication hook that notes when DDP hands it each bucket (the end of
        this rank's compute for measure()), then runs `hook`."""
        @functools.wraps(hook)  # DDP checks the signature: hook's, through __wrapped__
        def timed_hook(state: Any, bucket: Any) -> Any:
            self._posted = time.perf_counter()
            return hook(state, bucket)

        return timed_hook

    def step(self) -> bool:
        """After each training step: every `every` steps, agree on new shares from what
        every rank measured (collective: every rank calls it at the same steps). True when
        the shares changed."""
        self.steps += 1
        if self.steps < self.every:
            return False
        mine = np.array([[self._samples, self._seconds]], dtype=np.float64)
        rows = C.allgather(mine, process_set=self.process_set)
        self.steps, self._samples, self._seconds = 0, 0, 0.0
        if not all(s > 0 and t > 0 for s, t in rows.tolist()):
            return False  # a rank measured nothing: nothing to go on
        speeds = [s / t for s, t in rows.tolist()]
        new = proportional_shares(self.global_batch, speeds)
        if not better(self.shares, new, speeds, self.threshold):
            return False
        self.shares = new
        return True

    def reset(self) -> None:
        """Equal shares over the ranks as they are now (after an elastic shrink or growth)
        and a new measurement."""
        self.steps, self._samples, self._seconds = 0, 0, 0.0
        self.shares = self._even()

    def state_dict(self) -> dict[str, Any]:
        return {"shares": list(self.shares), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Shares saved at another size start over equal (reset)."""
        self.reset()
        if len(state["shares"]) == len(self.shares):
            self.shares = list(state["shares"])
            self.steps = state["steps"]


class BalancedSampler(torch.utils.data.Sampler):
    """A batch sampler: each global batch (balancer.global_batch consecutive indices of the
    epoch's order) dealt by the balancer's shares, this rank's part of it per batch. The
    shares are read as each batch is drawn, so every rank must draw the same way (the same
    DataLoader settings). shuffle: a permutation from (seed, epoch), the same on every rank.
    An epoch has len(dataset) // global_batch batches (the rest is left out, a different
    rest each shuffled epoch). Record each batch done (`record_batch`): a restart from
    `state_dict` goes on after the last one recorded, at the saved shares where the size is
    the same. In an elastic TorchState (among its keyword arguments, as an ElasticSampler)
    it is committed, restored and synced with the model, and after a change of size deals
    the rest of the epoch in equal shares until the balancer measures again."""

    def __init__(self, dataset: Any, balancer: Balancer, shuffle: bool = True, seed: int = 0):
        self.dataset, self.balancer, self.shuffle, self.seed = dataset, balancer, shuffle, seed
        self.epoch = 0
        self.done = 0  # global batches of this epoch every rank has stepped on
        self.start = 0  # the batch the pass starts from

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.done, self.start = epoch, 0, 0

    def record_batch(self, batch_idx: int) -> None:
        """Batch batch_idx (counted from this pass's start) is done on every rank."""
        self.done = self.start + batch_idx + 1

    def reset(self) -> None:
        """Deal the batches left over the ranks as they are now (equal shares again)."""
        self.start = self.done
        self.balancer.reset()

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the batches done in it and the balancer's shares."""
        return {"epoch": self.epoch, "done": self.done, "balancer": self.balancer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.done = state["epoch"], state["done"]
        self.start = self.done
        self.balancer.load_state_dict(state["balancer"])

    def _order(self) -> list[int]:
        return epoch_order(len(self.dataset), self.shuffle, self.seed, self.epoch)

    def __iter__(self) -> Iterator[list[int]]:
        order, batch = self._order(), self.balancer.global_batch
        rank = _rank(self.balancer.process_set)
        self.start = self.done  # a pass goes on after the last batch recorded
        for b in range(self.start, self._batches()):
            shares = self.balancer.shares
            first = b * batch + sum(shares[:rank])
            yield order[first:first + shares[rank]]

    def _batches(self) -> int:
        return len(self.dataset) // self.balancer.global_batch

    def __len__(self) -> int:
        """The batches of this pass: those of the epoch after `start`."""
        return self._batches() - self.start
