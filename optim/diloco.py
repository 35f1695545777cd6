"""DiLoCo (Douillard et al., 2023): each rank trains alone with its inner optimizer and the
ranks synchronize every `sync_every` (H) steps, averaging their parameter change since the
last synchronization (the outer gradient) and applying it with an outer optimizer to the
copy every rank shares. Streaming DiLoCo (2025): the parameters in `fragments` (F) parts,
synchronized in turn, each overlapped with the inner steps that follow it.

Schedule. The model's parameters (in registration order) are cut into F runs of about
equal size. Every H / F inner steps one fragment synchronizes, in turn (fragment k at
inner steps (k + 1) H / F, (k + 1) H / F + H, ...), so each one every H steps:
  1. its outer gradient: delta = anchor - params (anchor: the fragment at its last
     synchronization, the same on every rank), plus this rank's error feedback where the
     compression is lossy (the error is what its own quantization of delta left out);
  2. delta averaged over the ranks (`C.allreduce`, Average, under `compression`);
  3. the outer optimizer steps the fragment from the anchor with the average as gradient:
     the result is the new anchor, and the rank's fragment restarts from it.
With overlap, step 2 runs asynchronously and steps 3 happen at the next synchronization
point (H / F inner steps later: one fragment late), before the next fragment is sent; the
rank keeps the progress it made meanwhile: its fragment becomes the new anchor plus its
change since it was sent. Without overlap everything happens at the synchronization point.

Cost: per H inner steps, one allreduce of every parameter (under compression: int8 a
quarter of float32's bytes, int4 an eighth), against H allreduces of the gradients for
synchronous data parallelism; with F fragments the same bytes in F pieces, spread over
the H steps. Memory: the anchor (one copy of the parameters), the outer optimizer's
state (Nesterov SGD: one more), and for lossy compression one error buffer.

The defaults are the paper's outer optimizer (SGD, lr 0.7, momentum 0.9, Nesterov);
`outer_optimizer` may be any torch optimizer over the model's parameters (the same
tensors the inner one steps).
"""

from __future__ import annotations

from typing import Any

import torch

from collectives import api as C

from .wrapped import WrappedOptimizer, _check_int


def fragments_of(params: list[torch.Tensor], count: int) -> list[list[int]]:
    """The indices of params in `count` contiguous runs of about equal element counts
    (each at least one parameter)."""
    if count > len(params):
        raise ValueError(f"fragments: expected at most one per parameter ({len(params)}), "
                         f"got {count}")
    total = sum(p.numel() for p in params)
    runs: list[list[int]] = [[] for _ in range(count)]
    k, seen = 0, 0
    for i, p in enumerate(params):
        want = int((seen + p.numel() / 2) * count / total) if total else 0  # its middle's run
        lo = max(k, count - (len(params) - i))  # leave every later run a parameter
        hi = k + 1 if runs[k] else k  # runs stay contiguous, none empty
        k = max(lo, min(want, hi))
        runs[k].append(i)
        seen += p.numel()
    return runs


class _Sent:
    """A fragment's average in flight (or arrived), with what the rank had when it sent."""

    __slots__ = ("fragment", "handle", "average", "sent")

    def __init__(self, fragment: int, handle: Any, sent: torch.Tensor | None):
        self.fragment, self.handle, self.sent = fragment, handle, sent
        self.average: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self.average is None:
            self.average = torch.as_tensor(C.synchronize(self.handle))
            self.handle = None
        return self.average


class DiLoCo(WrappedOptimizer):
    """The inner optimizer, stepped alone on each rank, and every `sync_every` steps the
    outer step over the ranks' averaged parameter change (module docstring). step() steps
    the inner optimizer and, at a synchronization point, synchronizes a fragment (every
    rank calls step() the same number of times). compression: Compression.none, fp16,
    int8 or int4 (the last two with error feedback). process_set: the ranks that train
    together (None: the job)."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer | None = None, sync_every: int = 500,
                 fragments: int = 1, compression: Any = C.Compression.none,
                 overlap: bool = True, process_set: Any = None):
        super().__init__(inner_optimizer)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.sync_every = _check_int("sync_every", sync_every, 1)
        _check_int("fragments", fragments, 1)
        if sync_every % fragments:
            raise ValueError(f"sync_every: expected a multiple of fragments ({fragments}), "
                             f"got {sync_every}")
        if compression not in (C.Compression.none, C.Compression.fp16, C.Compression.int8,
                               C.Compression.int4):
            raise ValueError(f"compression: expected Compression.none, fp16, int8 or int4, "
                             f"got {compression!r}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap: expected a bool, got {type(overlap).__name__}")
        inner = {id(p) for g in inner_optimizer.param_groups for p in g["params"]}
        self.params = [p for p in model.parameters() if id(p) in inner]
        if not self.params:
            raise ValueError("model: none of its parameters is in inner_optimizer")
        if outer_optimizer is None:
            outer_optimizer = torch.optim.SGD(self.params, lr=0.7, momentum=0.9, nesterov=True)
        outer = {id(p) for g in outer_optimizer.param_groups for p in g["params"]}
        if outer != {id(p) for p in self.params}:
            raise ValueError("outer_optimizer: expected an optimizer over the parameters "
                             "the inner one steps")
        self.outer = outer_optimizer
        self.compression, self.overlap, self.process_set = compression, overlap, process_set
        self.fragments = fragments_of(self.params, fragments)
        self.anchor = [p.detach().clone() for p in self.params]
        lossy = compression in (C.Compression.int8, C.Compression.int4)
        self.errors = [self._flat_zeros(f) for f in self.fragments] if lossy else None
        self.steps = 0  # inner steps taken
        self.pending: _Sent | None = None

    def _flat_zeros(self, fragment: list[int]) -> torch.Tensor:
        return torch.zeros(sum(self.params[i].numel() for i in fragment),
                           dtype=self.params[fragment[0]].dtype)

    def _flat(self, tensors: list[torch.Tensor], fragment: list[int]) -> torch.Tensor:
        return torch.cat([tensors[i].detach().reshape(-1) for i in fragment])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The inner step; then, at a synchronization point, a fragment's outer step."""
        loss = self.optimizer.step(closure)
        self.steps += 1
        interval = self.sync_every // len(self.fragments)
        if self.steps % interval == 0:
            fragment = (self.steps // interval - 1) % len(self.fragments)
            if self.pending is not None:
                self._apply(self.pending)
                self.pending = None
            sent = self._send(fragment)
            if self.overlap:
                self.pending = sent
            else:
                self._apply(sent)
        return loss

    def _send(self, f: int) -> _Sent:
        fragment = self.fragments[f]
        now = self._flat(self.params, fragment)
        delta = self._flat(self.anchor, fragment) - now
        if self.errors is not None:
            delta += self.errors[f]
            q, ctx = self.compression.compress(delta)
            self.errors[f] = delta - torch.as_tensor(self.compression.decompress(q, ctx))
        handle = C.allreduce_async(delta, op=C.Average, compression=self.compression,
                                   process_set=self.process_set)
        return _Sent(f, handle, now if self.overlap else None)

    def _apply(self, sent: _Sent) -> None:
        """The outer step of sent's fragment from its anchor; the rank's fragment restarts
        there (plus, with overlap, what it changed since it sent)."""
        average = sent.wait()
        fragment = self.fragments[sent.fragment]
        kept = {i: self.params[i].grad for i in range(len(self.params))}
        now = {i: self.params[i].detach().clone() for i in fragment}
        for p in self.params:
            p.grad = None
        offset = 0
        for i in fragment:
            p, n = self.params[i], self.params[i].numel()
            p.copy_(self.anchor[i])
            p.grad = average[offset:offset + n].view_as(p).to(p.dtype)
            offset += n
        self.outer.step()
        offset = 0
        for i in fragment:
            p, n = self.params[i], self.params[i].numel()
            self.anchor[i].copy_(p)
            if sent.sent is not None:  # overlapped: keep the change made since it was sent
                p.add_(now[i] - sent.sent[offset:offset + n].view_as(p))
            offset += n
        for i, p in enumerate(self.params):
            p.grad = kept[i]

    @torch.no_grad()
    def synchronize(self) -> None:
        """Apply the fragment in flight now (before evaluating the shared copy, say)."""
        if self.pending is not None:
            self._apply(self.pending)
            self.pending = None

    @torch.no_grad()
    def use_anchor(self) -> None:
        """Set the model's parameters to the shared copy, the fragment in flight applied
        first: the same model on every rank, to evaluate or save as the job's (this rank's
        steps since each fragment's last synchronization are dropped)."""
        self.synchronize()
        for p, a in zip(self.params, self.anchor, strict=True):
            p.copy_(a)

    def state_dict(self) -> dict[str, Any]:
        """The inner and outer optimizers' states, the anchor, the error buffers, the step
        count and a fragment in flight (waited for, not yet applied: saving does not move
        the schedule)."""
        pending = None
        if self.pending is not None:
            self.pending.wait()
            pending = {"fragment": self.pending.fragment, "average": self.pending.average,
                       "sent": self.pending.sent}
        return {"inner": self.optimizer.state_dict(), "outer": self.outer.state_dict(),
                "anchor": [a.clone() for a in self.anchor], "steps": self.steps,
                "errors": None if self.errors is None else [e.clone() for e in self.errors],
                "size": C.size() if self.process_set is None else self.process_set.size(),
                "pending": pending}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Errors saved at another size start over at zero (they are per rank)."""
        self.optimizer.load_state_dict(state_dict["inner"])
        self.outer.load_state_dict(state_dict["outer"])
        with torch.no_grad():
            for a, saved in zip(self.anchor, state_dict["anchor"], strict=True):
                a.copy_(saved)
        self.steps = state_dict["steps"]
        size = C.size() if self.process_set is None else self.process_set.size()
        if self.errors is not None:
            same = state_dict["errors"] is not None and state_dict["size"] == size
            self.errors = [e.clone() for e in state_dict["errors"]] if same \
                else [self._flat_zeros(f) for f in self.fragments]
        pending = state_dict["pending"]
        self.pending = None
        if pending is not None:
            self.pending = _Sent(pending["fragment"], None, pending["sent"])
            self.pending.average = pending["average"]
