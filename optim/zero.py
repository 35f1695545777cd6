"""ZeRO on collectives: ZeroOptimizer shards the wrapped optimizer's state over the ranks
(stage 1), the gradients too (stage 2), and the parameters too (stage 3: optim/zero3.py
gathers each unit of the model around its forward and backward; the buckets below are
then per unit, and this rank's piece of each lives in its own tensor).

Layout. The trainable parameters, in backward order, are packed into buckets of one dtype
and device of at most fusion_threshold_bytes, and each parameter's .data becomes a view of
its bucket's flat buffer. Rank r owns the r-th even piece of every bucket (Horovod's row
split, the one C.reducescatter makes), so a bucket's gradients reduce-scatter straight into
their owners' pieces and its parameters allgather back from them. The wrapped optimizer
steps on this rank's pieces only: one tensor for each overlap of a parameter with this
rank's piece of its bucket, a view of the flat buffer, in the parameter's own param group.
Its state (momentum, Adam's moments) therefore covers 1/N of the parameters.

A step. During backward a hook counts each parameter's gradient. A bucket whose gradients
are all in is packed and its reducescatter (Average) launched while backward goes on, in
the fixed bucket order on every rank; stage 2 then frees the parameters' .grad. step()
waits for the reductions (at most IN_FLIGHT buckets are in flight: launching one more
first finishes the oldest), gives each piece its gradient, steps the wrapped optimizer and
allgathers every bucket from its owners' pieces into its flat buffer, which the parameters
view.

Cost per step: one reducescatter and one allgather of the parameters' bytes, what one
allreduce moves (the allgather a half, a quarter or an eighth of them with
parameter_compression fp16, int8 or int4).
Memory per rank: the parameters, 1/N of the optimizer state, and the gradients: all of
them in stage 1; in stage 2, 1/N of them plus, during backward, the gradients of the
bucket being filled and the IN_FLIGHT buckets' packed copies (a bucket is at most
fusion_threshold_bytes: smaller buckets, a lower peak).

Checkpoints. state_dict() is this rank's shard: the wrapped optimizer's state of its pieces
and where each piece lies (parameter, offset). load_state_dict() takes such a shard (same
layout), the list of every rank's shards saved at any world size (resharded here), or a
plain state dict of the wrapped optimizer; consolidated_state_dict() gives rank 0 that
plain dict, which a single-process torch optimizer over the same parameters loads.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from collectives import api as C

from . import zero3
from .overlap import Overlapped, bucketed
from .wrapped import _COMPRESSORS, _GRAD_DTYPES, _check_int
from .zero_buckets import (
    ONEBIT,
    Bucket,
    QuantizedBucket,
    ShardedBucket,
    gather_decode,
    gather_start,
    quantizes,
)
from .zero_shards import SHARD_FORMAT, full_states, is_sliced, slice_of

#: Buckets reduced at once during backward: a bucket launched beyond these first waits
#: for the oldest one (its packed gradients are then freed).
IN_FLIGHT = 2


class ZeroOptimizer(Overlapped):
    """Wraps a torch optimizer so that each rank keeps 1/N of its state (stage=1), of the
    gradients (stage=2), and of the parameters (stage=3, with module=the model: each of its
    `units`, by default each child module with parameters, is gathered for its forward and
    its backward, the next unit's gather prefetched; reshard_after_forward=False keeps a
    unit gathered from its forward to its backward; hpz=True keeps, from a unit's forward
    to its backward, this rank's piece of it among its node's ranks, so the backward's
    gather stays on the node, ZeRO++'s hierarchical partitioning, for 1/L of the
    parameters more memory with L ranks a node; optim/zero3.py). In stages 1 and 2 every
    rank holds all parameters, updated every step. parameter_compression=Compression.fp16,
    .int8 or .int4 (any stage) gathers float32 parameters as float16, or int8 or int4 (two
    values a byte) with a scale per block, which every rank decodes alike: the model
    computes with the decoded values, while the optimizer steps this rank's float32
    pieces (the masters, 1/N of the parameters more memory in stages 1 and 2), which the
    shards save; a reshard (elastic) starts the masters again from the decoded values.
    Like DistributedOptimizer it is a torch.optim.Optimizer whose param_groups and state are the
    wrapped one's (`.optimizer`, which holds this rank's pieces), so LR schedulers and
    zero_grad(set_to_none) work on it; gradients are averaged over the ranks (of
    process_set, which every rank of the job must belong to, or be outside of and not use
    this optimizer). compression=Compression.fp16 reduce-scatters the gradients in float16
    (half of float32's bytes, summed in float16); Compression.int8 sends each rank's piece
    as int8 with a scale per block (a quarter), summed in float32 by its owner; ONEBIT
    ("onebit") sends signs with one scale per onebit_block_size elements (None: one per
    piece), with error feedback: each rank keeps a float32 error buffer as large as the
    gradients (what it compresses is its whole gradient), saved in its shard and restarted
    at zeros when resharded.

    Wrap a fresh optimizer (no state yet) after the parameters are alike on every rank
    (broadcast_parameters), before the first backward. Parameters with requires_grad=False
    at construction are never stepped. backward_passes_per_step=k: gradients add up over k
    backward passes and are reduced during the k-th. With a GradScaler, reduce first, as
    with Horovod: `opt.synchronize(); scaler.unscale_(opt); with opt.skip_synchronize():
    scaler.step(opt)`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, stage: int = 2,
                 process_set: C.ProcessSet | None = None,
                 compression: Any = C.Compression.none, backward_passes_per_step: int = 1,
                 fusion_threshold_bytes: int = 64 << 20, onebit_block_size: int | None = 32,
                 module: torch.nn.Module | None = None,
                 units: list[torch.nn.Module] | None = None,
                 reshard_after_forward: bool = True, prefetch: bool = True,
                 parameter_compression: Any = C.Compression.none, hpz: bool = False):
        super().__init__(optimizer, backward_passes_per_step)
        if stage not in (1, 2, 3) or isinstance(stage, bool):
            raise ValueError(f"stage: expected 1, 2 or 3, got {stage!r}")
        if stage != 3 and (module is not None or units is not None or hpz):
            raise ValueError("module, units, hpz: for stage=3 only (stages 1 and 2 keep "
                             "every parameter whole)")
        if hpz and process_set is not None:
            raise ValueError("hpz: over the whole job only (process_set=None): its secondary "
                             "pieces are gathered over each node")
        if not any(parameter_compression is c for c in (C.Compression.none, C.Compression.fp16,
                                                          C.Compression.int8, C.Compression.int4)):
            raise ValueError(f"parameter_compression: expected Compression.none, fp16, int8 or "
                             f"int4, got {parameter_compression!r}")
        if process_set is not None and not isinstance(process_set, C.ProcessSet):
            raise TypeError(f"process_set: expected a collectives.ProcessSet, got "
                            f"{type(process_set).__name__}")
        if len(optimizer.state):
            raise ValueError("optimizer: expected a fresh optimizer (its state is sharded as "
                             "it is created); load saved state with load_state_dict() after "
                             "wrapping")
        if compression != ONEBIT and not any(compression is c for c in _COMPRESSORS.values()):
            raise ValueError(f"compression: expected Compression.none, fp16, int8, int4 or "
                             f"{ONEBIT!r}, got {compression!r}")
        if onebit_block_size is not None:
            _check_int("onebit_block_size", onebit_block_size, 1)
        self.stage = stage
        self._compression = compression
        self._block_size = onebit_block_size
        self._set = process_set
        self._threshold = _check_int("fusion_threshold_bytes", fusion_threshold_bytes, 0)
        self._parameter_compression = parameter_compression
        # every group's parameters as given (frozen ones too): the consolidated numbering
        self._groups = [list(g["params"]) for g in optimizer.param_groups]
        trainable = [p for g in self._groups for p in g if p.requires_grad]
        for p in trainable:
            if p.dtype not in _GRAD_DTYPES:
                raise TypeError(f"parameter of shape {tuple(p.shape)}: dtype {p.dtype} is not "
                                f"supported; expected one of {[str(d) for d in _GRAD_DTYPES]}")
        if len({id(p) for p in trainable}) != len(trainable):
            raise ValueError("optimizer: a parameter is in more than one param group")
        self._sharded: zero3.ShardedBuckets | None = None
        self._lay_out((module, units, reshard_after_forward, prefetch, hpz))

    def _lay_out(self, stage3: tuple = ()) -> None:
        """Buckets, this rank's pieces and their hooks for the process set's rank and size
        now; the wrapped optimizer's groups become the pieces. stage3: __init__'s unit
        arguments (only __init__ lays out stage 3)."""
        self._rank = rank = C.rank() if self._set is None else self._set.rank()
        self._size = C.size() if self._set is None else self._set.size()
        trainable = [p for g in self._groups for p in g if p.requires_grad]
        onebit = self._compression == ONEBIT
        whole = trainable
        buckets: list[Bucket] = []
        if self.stage == 3:
            module, units, reshard_after_forward, prefetch, hpz = stage3
            chosen = zero3.check_units(module, units, trainable)
            per_unit, whole = zero3.assign(module, chosen, trainable, self._threshold)
            self._sharded = zero3.ShardedBuckets(module, chosen, self._set,
                                                 bool(reshard_after_forward), bool(prefetch),
                                                 zero3.node_group() if hpz else None)
            for i in reversed(range(len(chosen))):  # backward reaches the last unit first
                for ps in per_unit[i]:
                    bucket = ShardedBucket(ps, rank, self._size, onebit,
                                            self._parameter_compression)
                    self._sharded.add(i, bucket)
                    buckets.append(bucket)
            self._sharded.hook()
            weakref.finalize(self, self._sharded.remove_hooks)
        quantized = self._parameter_compression
        self._watch(buckets + [
            QuantizedBucket(ps, rank, self._size, onebit, quantized)
            if quantizes(ps[0].dtype, quantized) else Bucket(ps, rank, self._size, onebit)
            for ps in bucketed(list(reversed(whole)), self._threshold)])
        group_of = {id(p): k for k, g in enumerate(self._groups) for p in g}
        pieces: list[list[torch.Tensor]] = [[] for _ in self._groups]
        self._placement: list[list[tuple[int, int, int]]] = [[] for _ in self._groups]
        for bucket in self._buckets:
            for p, offset, piece, _ in bucket.pieces:
                k = group_of[id(p)]
                pieces[k].append(piece)
                self._placement[k].append((_index(self._groups[k], p), offset, piece.numel()))
        self._pieces = pieces
        for group, mine in zip(self.optimizer.param_groups, pieces):
            group["params"] = mine

    def reshard(self) -> None:
        """Lay this optimizer out again for its process set's size now (after the job
        shrank or grew: collectives.elastic), its state empty until load_state_dict()
        loads the old size's shards, or only their parts over this rank's new pieces
        (zero_shards.part_of(shard, self.placement)). Stages 1 and 2: every rank holds the
        whole model, which the buckets take over as it is."""
        if self.stage == 3:
            raise NotImplementedError("reshard(): stage 3 keeps only pieces of the "
                                      "parameters; save its shards and load them into a new "
                                      "ZeroOptimizer instead")
        self._check_idle("reshard()")
        self._abandon()
        self._unwatch()
        for group, params in zip(self.optimizer.param_groups, self._groups):
            group["params"] = list(params)
        self.optimizer.state.clear()
        self._lay_out()

    @property
    def placement(self) -> list[list[tuple[int, int, int]]]:
        """This rank's pieces, per param group: (parameter's index in its group, offset in
        the parameter, length)."""
        return [list(g) for g in self._placement]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._wrapping:
            return
        raise NotImplementedError("ZeroOptimizer: add_param_group after wrapping is not "
                                  "supported; give the wrapped optimizer every group first")

    @property
    def process_set(self) -> C.ProcessSet | None:
        """The process set the shards are spread over (None: the whole job)."""
        return self._set

    # ---- a step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (the parameters' and the pieces') and any partly
        accumulated backward passes."""
        self._check_idle("zero_grad()")
        self._reset_counts()
        for bucket in self._buckets:
            for p in bucket.params:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce the gradients (unless inside skip_synchronize()), step this rank's pieces
        and allgather the updated parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._skip:
            self._synchronize()
        elif not self._synchronized:
            raise RuntimeError("step() inside skip_synchronize() with gradients not yet "
                               "reduced: call synchronize() before the with block")
        self.optimizer.step()
        self._gather_whole()
        if self._sharded is not None:
            self._sharded.free_all()  # a unit still gathered (an eval forward) is stale now
            self._sharded.forget_secondary()
        self._synchronized = False
        return loss

    def _gather_whole(self) -> None:
        """Every whole bucket's flat buffer from its owners' pieces, decoded alike on every
        rank where they are gathered quantized (stage 3's sharded buckets are gathered by
        the next forward)."""
        whole = [b for b in self._buckets if not isinstance(b, ShardedBucket)]
        started = [gather_start(b.piece(), b.quantized, self._set) for b in whole]
        with torch.no_grad():
            for bucket, handles in zip(whole, started):
                parts = [C.synchronize(h) for h in handles]
                bucket.flat.copy_(gather_decode(parts, bucket.quantized, bucket.bounds))

    # ---- stage 3: the parameters
    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Collective: within the block every parameter holds its whole value (stage 3
        gathers every unit and frees them after; stages 1 and 2 hold them anyway), to read,
        evaluate or save the model."""
        if self._sharded is None:
            yield
            return
        with self._sharded.gathered():
            yield

    def model_state_dict(self) -> dict[str, Any]:
        """Collective: the model's state_dict with every parameter whole (copies), which
        the same model without this optimizer loads. Stage 3 only (else model.state_dict())."""
        if self._sharded is None:
            raise RuntimeError("model_state_dict(): for stage=3; with stage 1 or 2 every rank "
                               "holds the whole model: call model.state_dict()")
        with self.gathered():
            return {k: v.detach().clone() for k, v in self._sharded.module.state_dict().items()}

    @property
    def gathered_bytes(self) -> int:
        """Stage 3: bytes of sharded parameters gathered (or being gathered) now, and, with
        hpz, the node pieces kept from a forward for its backward."""
        return 0 if self._sharded is None else self._sharded.gathered_bytes

    @property
    def peak_gathered_bytes(self) -> int:
        """Stage 3: the most gathered_bytes held at once since construction."""
        return 0 if self._sharded is None else self._sharded.peak_gathered_bytes

    def synchronize(self) -> None:
        """Finish reducing this step's gradients into the pieces' .grad; a no-op if done."""
        self._synchronize()

    # ---- the buckets (Overlapped)
    in_flight = IN_FLIGHT

    def _label(self, param: torch.Tensor) -> str:
        return f"a parameter of shape {tuple(param.shape)}"

    def _launch(self, bucket: Bucket) -> None:
        bucket.launch(self._set, self._compression, self._block_size, self.stage >= 2)

    def _finish(self, bucket: Bucket) -> None:
        bucket.finish()

    def _grad_ready(self, param: torch.Tensor, bucket: Bucket) -> None:
        if param.grad is not None and param.grad.is_sparse:
            raise RuntimeError(f"ZeroOptimizer: the gradient of {self._label(param)} is "
                               f"sparse; shards are dense (use DistributedOptimizer, or a "
                               f"dense embedding)")
        super()._grad_ready(param, bucket)

    # ---- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the wrapped optimizer's state dict (of its pieces) and each
        piece's place, (parameter index in its group, offset, length), per group."""
        shard = self.live_shard()
        shard["errors"] = [e.clone() for e in shard["errors"]]
        shard["parameters"] = [[piece.detach().clone() for piece in g] for g in self._pieces]
        return shard

    def live_shard(self) -> dict[str, Any]:
        """state_dict() less the parameters' pieces, its tensors the optimizer's own (as
        torch's state_dict gives them), not copies: for a caller that copies it at once
        (an elastic job's buddy copies, whose ranks hold the whole model anyway)."""
        return {"format": SHARD_FORMAT, "world_size": self._size,
                "numels": [[p.numel() for p in g] for g in self._groups],
                "placement": [list(g) for g in self._placement],
                "optimizer": self.optimizer.state_dict(),
                "errors": [b.error for b in self._buckets if b.error is not None]}

    def load_state_dict(self, state_dict: Any) -> None:
        """Load a shard of this layout, the list of every rank's shards (any world size:
        resharded), or a plain state dict of the wrapped optimizer (consolidated)."""
        full, groups = full_states(state_dict, self._groups)
        state: dict[int, dict[str, Any]] = {}
        index = 0
        for k, placement in enumerate(self._placement):
            for i, offset, length in placement:
                entry = full.get((k, i))
                if entry is not None:
                    state[index] = {key: slice_of(value, offset, length)
                                    for key, value in entry.items()}
                index += 1
        numbered, start = [], 0
        for group, placement in zip(groups, self._placement):
            numbered.append({**group, "params": list(range(start, start + len(placement)))})
            start += len(placement)
        self.optimizer.load_state_dict({"state": state, "param_groups": numbered})
        self._load_errors(state_dict)
        if any(hasattr(b, "shard") for b in self._buckets):
            self._load_parameters(state_dict)

    def _load_parameters(self, saved: Any) -> None:
        """Stage 3 and parameter_compression, whose float32 masters are the pieces: the
        parameters' pieces from shards that carry them (a plain optimizer state dict has
        none: the model's own values stay), then the whole buckets gathered from their
        owners."""
        shards = [saved] if isinstance(saved, dict) else list(saved)
        if not all(isinstance(s, dict) and "parameters" in s for s in shards):
            return
        full: dict[tuple[int, int], torch.Tensor] = {}
        numels = [[p.numel() for p in g] for g in self._groups]
        for shard in shards:
            for k, (placement, values) in enumerate(zip(shard["placement"],
                                                        shard["parameters"])):
                for (i, offset, length), value in zip(placement, values):
                    if (k, i) not in full:
                        full[(k, i)] = torch.zeros(numels[k][i], dtype=value.dtype)
                    full[(k, i)][offset:offset + length] = value
        if self._sharded is not None:
            self._sharded.free_all()
        with torch.no_grad():
            for k, placement in enumerate(self._placement):
                for (i, offset, length), piece in zip(placement, self._pieces[k]):
                    if (k, i) in full:
                        piece.copy_(full[(k, i)][offset:offset + length])
        self._gather_whole()

    def _load_errors(self, saved: Any) -> None:
        """1-bit's error buffers: this rank's saved ones where the layout is the same (its
        own shard, or the list saved at this world size), else zeros."""
        mine = saved if isinstance(saved, dict) else saved[self._rank] \
            if isinstance(saved, (list, tuple)) and len(saved) == self._size else None
        errors = mine.get("errors") if isinstance(mine, dict) and \
            mine.get("world_size") == self._size else None
        ours = [b.error for b in self._buckets if b.error is not None]
        same = errors is not None and len(errors) == len(ours) and all(
            e.shape == o.shape for e, o in zip(errors, ours))
        for k, error in enumerate(ours):
            if same:
                error.copy_(errors[k])
            else:
                error.zero_()

    def consolidated_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """Collective: on rank `to` (of the process set), the wrapped optimizer's state dict
        as a single process over every parameter would have it; None elsewhere."""
        shards = C.allgather_object(self.state_dict(), process_set=self._set)
        rank = C.rank() if self._set is None else self._set.rank()
        if rank != to:
            return None
        full, groups = full_states(shards, self._groups)
        state, numbered, index = {}, [], 0
        for k, (group, params) in enumerate(zip(groups, self._groups)):
            numbered.append({**group, "params": list(range(index, index + len(params)))})
            for i, p in enumerate(params):
                entry = full.get((k, i))
                if entry is not None:
                    state[index + i] = {key: value.view(p.shape) if is_sliced(value, p.numel())
                                        else value for key, value in entry.items()}
            index += len(params)
        return {"state": state, "param_groups": numbered}


# ------------------------------------------------------------------------ helpers

def _index(params: list[torch.Tensor], p: torch.Tensor) -> int:
    return next(i for i, q in enumerate(params) if q is p)
