"""Gradients reduced in buckets while backward runs: what DistributedOptimizer and
ZeroOptimizer share.

A post-accumulate-grad hook on each parameter counts its backward passes; when a bucket's
gradients are all complete it is launched (an async collective). Buckets launch in their
fixed order on every rank, a bucket ready early waiting for the ones before it, so every
rank issues the same collectives whatever order its hooks fire in. synchronize() launches
the rest (zeros for gradients that never came) and finishes them all; step() calls it
unless inside skip_synchronize()."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .wrapped import WrappedOptimizer, _check_int


def bucketed(params: list[torch.Tensor], threshold: int) -> list[list[torch.Tensor]]:
    """params in buckets of one dtype and device of at most threshold bytes each (a larger
    parameter alone), in the order of each bucket's first parameter."""
    buckets: list[list[torch.Tensor]] = []
    sizes: list[int] = []
    open_bucket: dict[tuple, int] = {}  # (dtype, device) -> index of the bucket being filled
    for p in params:
        key, nbytes = (p.dtype, p.device), p.numel() * p.element_size()
        i = open_bucket.get(key)
        if i is None or sizes[i] + nbytes > threshold:
            i = open_bucket[key] = len(buckets)
            buckets.append([])
            sizes.append(0)
        buckets[i].append(p)
        sizes[i] += nbytes
    return buckets


def count_pass(counts: dict[int, int], param: torch.Tensor, passes: int, label: str,
               then: str) -> int:
    """Count one more backward pass for param in counts (by id) and return its count;
    RuntimeError past `passes` (backward_passes_per_step), naming the parameter (label) and
    what to call (`then`) after every `passes` passes."""
    count = counts.get(id(param), 0) + 1
    if count > passes:
        raise RuntimeError(
            f"gradient of {label} computed {count} times since the last reduction with "
            f"backward_passes_per_step={passes}; call {then} after every {passes} backward "
            f"passes")
    counts[id(param)] = count
    return count


def _hook(owner: weakref.ref, bucket: Any) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook reporting to the optimizer while it is alive."""
    def hook(param: torch.Tensor) -> None:
        opt = owner()
        if opt is not None:
            opt._grad_ready(param, bucket)
    return hook


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()


class Overlapped(WrappedOptimizer):
    """A WrappedOptimizer whose gradients are reduced in buckets during backward. A bucket
    has `params` and a `ready` count; subclasses say how one is launched and finished
    (_launch, _finish) and name a parameter in errors (_label)."""

    #: Buckets in flight at most (None: no limit): launching one more first finishes the
    #: oldest, so that its buffers are freed during backward.
    in_flight: int | None = None

    def __init__(self, optimizer: torch.optim.Optimizer, backward_passes_per_step: int):
        super().__init__(optimizer)
        self._passes = _check_int("backward_passes_per_step", backward_passes_per_step, 1)
        self._buckets: list[Any] = []
        self._next = 0  # buckets launched this step
        self._done = 0  # of those, finished
        self._counts: dict[int, int] = {}  # id(param) -> backward passes since the last reduction
        self._synchronized = False
        self._skip = False
        self._lock = threading.Lock()
        self._hooks: list = []
        weakref.finalize(self, _remove_hooks, self._hooks)

    # ---- for subclasses
    def _launch(self, bucket: Any) -> None:
        raise NotImplementedError

    def _finish(self, bucket: Any) -> None:
        raise NotImplementedError

    def _label(self, param: torch.Tensor) -> str:
        raise NotImplementedError

    def _watch(self, buckets: list[Any]) -> None:
        """Add buckets after the others and hook their parameters."""
        owner = weakref.ref(self)
        for bucket in buckets:
            for p in bucket.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(_hook(owner, bucket)))
        self._buckets.extend(buckets)

    def _unwatch(self) -> None:
        """Drop every bucket and its parameters' hooks (before laying them out again)."""
        _remove_hooks(self._hooks)
        self._hooks.clear()
        self._buckets = []
        self._counts.clear()

    def _check_idle(self, what: str) -> None:
        if self._next:
            raise RuntimeError(f"{what} called while gradients are being reduced (after "
                               f"backward, before step() or synchronize()); call step() or "
                               f"synchronize() first")

    def _reset_counts(self) -> None:
        self._counts.clear()
        for bucket in self._buckets:
            bucket.ready = 0

    # ---- the overlap
    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block step() does not reduce (the gradients were reduced by an
        explicit synchronize(), e.g. to clip them or to unscale them first)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def _synchronize(self) -> None:
        """Launch the buckets not launched yet, in order, and finish every one; a no-op if
        done since the last backward."""
        with self._lock:
            if self._synchronized:
                return
            try:
                while self._next < len(self._buckets):
                    self._launch_next()
                for bucket in self._buckets[self._done:]:
                    self._finish(bucket)
            except BaseException:
                self._abandon()
                raise
            self._next = self._done = 0
            self._counts.clear()
            self._synchronized = True

    def _abandon(self) -> None:
        """Forget a step whose reductions failed (ranks died: collectives.elastic restores
        the last commit and trains on), so the next backward starts a fresh step."""
        self._next = self._done = 0
        self._reset_counts()
        for bucket in self._buckets:
            bucket.drop()
        self._synchronized = True

    def _grad_ready(self, param: torch.Tensor, bucket: Any) -> None:
        """Hook: count a backward pass for param; launch the complete buckets in order."""
        with self._lock:
            count = count_pass(self._counts, param, self._passes, self._label(param),
                               "step() (or synchronize())")
            self._synchronized = False
            if count < self._passes:
                return
            bucket.ready += 1
            try:
                while self._next < len(self._buckets) and \
                        self._buckets[self._next].ready == len(self._buckets[self._next].params):
                    self._launch_next()
            except BaseException:
                self._abandon()
                raise

    def _launch_next(self) -> None:
        self._launch(self._buckets[self._next])
        self._next += 1
        if self.in_flight is not None and self._next - self._done > self.in_flight:
            self._finish(self._buckets[self._done])
            self._done += 1
