"""A model, its optimizer, samplers and plain values as one elastic state (Horovod's
TorchState and ElasticSampler)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import torch

from collectives.elastic.buddies import Buddies, from_snapshot, regather
from collectives.elastic.state import ObjectState
from collectives.optim import (
    BalancedSampler,
    ZeroOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from collectives.optim.balance import epoch_order
from collectives.runtime import topology


class ElasticSampler(torch.utils.data.Sampler):
    """Each rank's share of a dataset's indices for one epoch, which, after the job shrank,
    deals only the indices not yet processed over the survivors. Record each batch
    (`record_batch`) and keep the sampler in a TorchState; `set_epoch` starts a new epoch.
    shuffle: a permutation drawn from (seed, epoch), the same on every rank."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed = 0  # indices of this epoch's order that every rank has processed
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.processed = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Batch batch_idx (of batch_size samples a rank) of this pass is done on every rank."""
        self.processed = self.start + (batch_idx + 1) * batch_size * self.size

    def reset(self) -> None:
        """Deal the indices not processed yet over the job's ranks as it is now."""
        self.rank, self.size = topology.rank(), topology.size()
        self.start = min(self.processed, len(self.dataset))
        left = len(self.dataset) - self.start
        self.per_rank = math.ceil(left / self.size) if left else 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed": self.processed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.processed = state["epoch"], state["processed"]
        self.reset()

    def _order(self) -> list[int]:
        return epoch_order(len(self.dataset), self.shuffle, self.seed, self.epoch)

    def __iter__(self) -> Iterator[int]:
        left = self._order()[self.start:]
        need = self.per_rank * self.size  # an even deal: repeat indices to fill it
        left = (left * -(-need // len(left)))[:need] if left else []
        return iter(left[self.rank::self.size])

    def __len__(self) -> int:
        return self.per_rank


class TorchState(ObjectState):
    """model's state_dict, optimizer's state_dict (OnebitAdam's with its 1-bit error
    buffers), every ElasticSampler and BalancedSampler among kwargs and the other kwargs'
    values, as one elastic state: commit copies them in memory, restore loads the copies,
    sync broadcasts rank 0's parameters, optimizer state, samplers' positions (and a
    BalancedSampler's shares) and values.

    A ZeroOptimizer (stage 1 or 2, over the whole job) is kept differently, as each rank
    holds only its shard: at a commit (collective) every rank's shard is also copied to
    another rank (elastic/buddies.py), and after the job shrank or grew the optimizer is
    resharded to the new size from those copies."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any):
        self._buddies: Buddies | None = None
        if isinstance(optimizer, ZeroOptimizer):
            if optimizer.stage == 3 or optimizer.process_set is not None:
                raise ValueError("optimizer: a ZeroOptimizer in an elastic state must be of "
                                 "stage 1 or 2 over the whole job (process_set=None): stage 3 "
                                 "shards the parameters too, which a replacement cannot "
                                 "rebuild from the copies yet")
            self._buddies = Buddies(optimizer)
        self.model, self.optimizer = model, optimizer
        self._samplers = {k: v for k, v in kwargs.items()
                          if isinstance(v, (ElasticSampler, BalancedSampler))}
        for k, sampler in self._samplers.items():
            setattr(self, k, sampler)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in self._samplers})
        self._saved_torch: dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        # The snapshot in flight reads the last commit's copies, which _copy refills in
        # place: it must be on disk first, whoever saves (a commit, or the sync after a
        # shrink, which may bring rank 0's later commit).
        self.flush_snapshots()
        if self._buddies is not None:
            # first: every rank commits, or none does
            self._buddies.commit(snapshots=self._writer is not None)
        # Every part first: an optimizer's state_dict may wait for reductions in flight
        # (DiLoCo's outer average) and raise when a rank died; the last commit's tensors,
        # which the copies below overwrite in place, must then still be that commit's.
        parts: dict[str, Any] = {}
        if self.model is not None:
            parts["model"] = self.model.state_dict()
        if self.optimizer is not None and self._buddies is None:
            parts["optimizer"] = self.optimizer.state_dict()
        saved: dict[str, Any] = {"samplers": {k: s.state_dict()
                                              for k, s in self._samplers.items()}}
        last = self._saved_torch
        for name, part in parts.items():
            saved[name] = _copy(part, last.get(name))
        self._saved_torch = saved
        super().save()

    def restore(self) -> None:
        saved = self._saved_torch
        if self.model is not None:
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None and self._buddies is None:  # else: reset reshards it
            self.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
        for k, s in self._samplers.items():
            s.load_state_dict(saved["samplers"][k])
        super().restore()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None and self._buddies is None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for s in self._samplers.values():
            s.load_state_dict(self._bcast_object(s.state_dict(), 0))
        super().sync()
        self.save()

    def replicated_snapshot(self) -> Any:
        return {"values": self._saved, "torch": self._saved_torch}

    def load_replicated(self, replicated: Any) -> None:
        self._saved_torch = replicated["torch"]
        self._saved = replicated["values"]
        self.restore()

    def shard_snapshot(self) -> tuple[Any, int | None]:
        if self._buddies is None:
            return None, None
        return self._buddies.snapshot(), self._buddies.held_from

    @property
    def sharded(self) -> bool:
        return self._buddies is not None

    def load_shards(self, old_size: int, parts: dict[int, Any]) -> None:
        self.optimizer.reshard()
        self.optimizer.load_state_dict(regather(
            self.optimizer, old_size, {d: from_snapshot(p) for d, p in parts.items()}))

    def reset(self) -> None:
        if self._buddies is not None:
            self.optimizer.reshard()
            self.optimizer.load_state_dict(self._buddies.parts())
        for s in self._samplers.values():
            s.reset()


def _copy(obj: Any, last: Any) -> Any:
    """A copy of obj (a state dict), each tensor copied into the tensor at the same place in
    last (the previous commit) where it has the same shape, dtype and device, else cloned:
    a commit per step then reuses its memory instead of faulting in fresh pages."""
    if isinstance(obj, torch.Tensor):
        if isinstance(last, torch.Tensor) and last.shape == obj.shape \
                and last.dtype == obj.dtype and last.device == obj.device:
            return last.copy_(obj.detach())
        return obj.detach().clone()
    if isinstance(obj, dict):
        last = last if isinstance(last, dict) else {}
        return {k: _copy(v, last.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        lasts = last if isinstance(last, type(obj)) and len(last) == len(obj) \
            else [None] * len(obj)
        return type(obj)(_copy(v, w) for v, w in zip(obj, lasts))
    return copy.deepcopy(obj)
