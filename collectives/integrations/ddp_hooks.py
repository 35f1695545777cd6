"""DDP communication hooks: DDP's gradient buckets averaged, plain or under compression.

    ddp.register_comm_hook(None, fp16_hook)          # state: a process group, or None
    ddp.register_comm_hook(MPI.COMM_WORLD, allreduce_hook)   # or an mpi4py communicator
    ddp.register_comm_hook(None, int8_hook)          # or int4_hook
    state = OnebitHookState(warmup_steps=100)
    ddp.register_comm_hook(state, onebit_hook)       # save state.state_dict() with the model
    ddp.register_comm_hook(TopKHookState(ratio=0.01), topk_hook)   # the same

  fp16    float16 on the wire: half of float32's bytes.
  int8    our block-int8 (one float32 scale per block of kernels.INT8_BLOCK_SIZE values):
          about a quarter of float32's bytes. On our backend the library's allreduce
          (compression.BlockQuantizer: every rank's bucket allgathered and summed in rank
          order, or two phases whose bytes do not grow with the ranks, whichever `auto`
          prices cheaper); on another backend the allgather form. Every rank gets the
          same bits.
  int4    the same with block-int4 values, two a byte (kernels.INT4_BLOCK_SIZE values a
          scale): about an eighth of float32's bytes, each value within 1/14 of its
          block's largest.
  1-bit   signs plus a float32 scale per 32 values (OnebitHookState.block_size), with
          error feedback on the worker and the server side (compression/onebit.py): ~1/16
          of float32's bytes. What one step's compression loses is sent in the next, so the
          sum of the averaged gradients tracks the exact one. It is applied to the gradients
          themselves (no momentum), so it suits SGD and Adam alike; the first
          warmup_steps steps run uncompressed, as 1-bit Adam's freeze steps do, while the
          gradients settle.
  Top-K  the largest ratio x n values of each bucket as (int32 index, float32 value) pairs,
          with error feedback (compression/topk.py): what a step does not send stays in
          the bucket's residual (TopKHookState) and is sent later. Every rank's pairs are
          allgathered and summed in rank order: (n - 1) 8 ratio x n bytes received per
          rank, cheaper than float32 while ratio < 1 / n.
Every hook works on any process group. On the "collectives" backend a bucket is one async
call of ours on the group's communicator, overlapping backward as DDP's own allreduce does;
on another backend (gloo) the same algorithm runs over torch.distributed's collectives
(all_gather_single, all_to_all_single), synchronously inside the hook. The state may also
be an mpi4py communicator whose ranks are the group's, in the same order: the buckets then
go through this library on it whatever backend the group has, for frameworks that set up
gloo themselves (Accelerate on CPU: docs/integrations.md, "Running under Hugging Face
Accelerate")."""

# No `from __future__ import annotations`: DDP checks a hook's annotations as objects.
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.futures import Future

from collectives import api, kernels
from collectives.algorithms.onebit import error_sizes
from collectives.api.compressed import compressed_allreduce_async
from collectives.compression import Compression, onebit, topk
from collectives.integrations import torch_backend, torch_work
from collectives.ops import ReduceOp


def _group(state: Any) -> Any:
    return state if state is not None else dist.group.WORLD


class _Ours(NamedTuple):
    comm: MPI.Comm | None  # the communicator the library's call runs on (None: the job's)


def _ours(group: Any) -> _Ours | None:
    """How a bucket goes through this library: on our backend's group's communicator (the
    default group's is the job's), or on an mpi4py communicator given as the state; None
    for another backend's group."""
    if isinstance(group, torch_backend.ProcessGroup):
        return _Ours(group.comm)
    return _Ours(group) if isinstance(group, MPI.Comm) else None


def _size(group: Any) -> int:
    return group.Get_size() if isinstance(group, MPI.Comm) else group.size()


def _average(bucket: dist.GradBucket, group: Any, compression: Any) -> Future[torch.Tensor]:
    """The bucket averaged over group in place, under compression (none or fp16)."""
    buffer = bucket.buffer()
    ours = _ours(group)
    if ours is not None:
        return torch_work.future(api.allreduce_async_(buffer, ReduceOp.Average,
                                                    compression=compression, comm=ours.comm))
    wire = buffer if compression is Compression.none else buffer.to(torch.float16)
    wire.div_(group.size())

    def unpack(future: Future[list]) -> torch.Tensor:
        return buffer if wire is buffer else buffer.copy_(future.value()[0])

    return dist.all_reduce(wire, group=group, async_op=True).get_future().then(unpack)


def allreduce_hook(state: Any, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Average the bucket uncompressed (DDP's own allreduce, through this library when state
    is an mpi4py communicator or the group is ours). state: the process group (None: the
    default group) or an mpi4py communicator."""
    return _average(bucket, _group(state), Compression.none)


def fp16_hook(state: Any, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Average the bucket with float16 on the wire. state: the process group (None: the
    default group)."""
    return _average(bucket, _group(state), Compression.fp16)


#: torch 2.13's name for all_gather_into_tensor, which older torch has alone
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather_rows(part: torch.Tensor, group: Any) -> np.ndarray:
    """Every rank's part (1-D, the same size everywhere) as rows, over any group."""
    rows = part.new_empty((group.size(), part.numel()))
    _all_gather_single(rows.view(-1), part, group=group)
    return rows.numpy()


def _quantized(state: Any, bucket: dist.GradBucket, codec: Any) -> Future[torch.Tensor]:
    """The bucket averaged under a block quantizer (int8, int4): on our group one call of
    the library (its form `auto`'s choice); on another backend the allgather form over its
    collectives (the bits of the library's call in that form)."""
    group, buffer = _group(state), bucket.buffer()
    ours = _ours(group)
    if ours is not None:
        return torch_work.future(api.allreduce_async_(buffer, ReduceOp.Average,
                                                    compression=codec, comm=ours.comm))
    q, (scales, shape, _) = codec.compress(buffer)
    # a Sum, divided here: the call is not on our engine, so no rank of it has joined
    total = codec.combine(_gather_rows(q, group), _gather_rows(scales, group), shape,
                          ReduceOp.Sum, group.size())
    kernels.divide(total, "float32", group.size())
    return torch_work.done(buffer.copy_(torch.from_numpy(total).view(buffer.shape)))


def int8_hook(state: Any, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Average the bucket as block-int8 values and scales. state: the process group (None:
    the default group)."""
    return _quantized(state, bucket, Compression.int8)


def int4_hook(state: Any, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Average the bucket as block-int4 values (two a byte) and scales. state: the process
    group (None: the default group)."""
    return _quantized(state, bucket, Compression.int4)


class OnebitHookState:
    """onebit_hook's state: the process group, the warm-up length, the scale block size
    (one float32 scale per block_size values, so 1 + 32 / block_size bits per value; None:
    one per chunk, as DeepSpeed scales momentum; a scale per block follows the magnitudes
    of the values around it, so smaller blocks lose less accuracy against uncompressed
    training, for more bits: benchmarks/README.md, Hook convergence) and,
    per bucket, this rank's error buffers with the layout they were made for (the shapes of
    the bucket's parameters, in order).

    state_dict() / load_state_dict() save and restore the step count and the buffers with
    a checkpoint. A resumed run repeats the uninterrupted one bit for bit when DDP lays
    out its buckets as it did when the state was saved. DDP builds its buckets in reverse
    parameter order, then, unless find_unused_parameters=True, rebuilds them once after
    the first step in the order the gradients became ready; a bucket whose layout differs
    from its saved buffers' starts again from zero errors (the buffers are positional, so
    applying them to other parameters would be wrong)."""

    def __init__(self, process_group: Any = None, warmup_steps: int = 10,
                 block_size: int | None = 32):
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) \
                or warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected an int >= 0, got {warmup_steps!r}")
        onebit.check_block(block_size)
        self.process_group = process_group
        self.warmup_steps, self.block_size = warmup_steps, block_size
        self.step = 0  # backward passes seen
        #: bucket index -> (layout, worker error, server error): float32 tensors on the
        #: bucket's device (CUDA buckets are compressed on the device)
        self.errors: dict[int, tuple[tuple, torch.Tensor, torch.Tensor]] = {}

    def _errors(self, bucket: dist.GradBucket, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's (worker, server) error buffers on its device; new zeros if its
        layout changed, moved if they were restored onto another device."""
        layout = tuple(tuple(p.shape) for p in bucket.parameters())
        device = bucket.buffer().device
        found = self.errors.get(bucket.index())
        if found is None or found[0] != layout:
            worker, server = error_sizes(bucket.buffer().numel(), ranks)
            found = (layout, torch.zeros(worker, device=device),
                     torch.zeros(server, device=device))
        elif found[1].device != device:
            found = (layout, found[1].to(device), found[2].to(device))
        self.errors[bucket.index()] = found
        return found[1], found[2]

    def state_dict(self) -> dict:
        return {"step": self.step, "warmup_steps": self.warmup_steps,
                "block_size": self.block_size,
                "errors": {i: (layout, w.clone(), s.clone())
                           for i, (layout, w, s) in self.errors.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.warmup_steps = state["step"], state["warmup_steps"]
        self.block_size = state["block_size"]
        self.errors = {int(i): (tuple(map(tuple, layout)), torch.as_tensor(w).clone(),
                                torch.as_tensor(s).clone())
                       for i, (layout, w, s) in state["errors"].items()}


def onebit_hook(state: OnebitHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Average the bucket as 1-bit signs and scales with error feedback (state's warm-up
    steps run uncompressed)."""
    if not isinstance(state, OnebitHookState):
        raise TypeError(f"state: expected an OnebitHookState, got {type(state).__name__}")
    group, buffer = _group(state.process_group), bucket.buffer()
    warm = state.step < state.warmup_steps
    if bucket.is_last():
        state.step += 1
    if warm:
        return _average(bucket, group, Compression.none)
    worker, server = state._errors(bucket, _size(group))
    ours = _ours(group)
    if ours is not None:
        handle = compressed_allreduce_async(buffer, worker, server, state.block_size,
                                            comm=ours.comm)
        return torch_work.future(handle)
    n = group.size()

    def scatter(rows: np.ndarray) -> np.ndarray:
        received = torch.empty(rows.shape, dtype=torch.uint8)
        dist.all_to_all_single(received, torch.from_numpy(rows), group=group)
        return received.numpy()

    def gather(packet: np.ndarray) -> np.ndarray:
        return _gather_rows(torch.from_numpy(packet), group)

    # another backend's group: the exchange through it, the arithmetic on the host (a CUDA
    # bucket's values and error buffers copied there and back)
    w, s = worker.cpu(), server.cpu()
    total = onebit.reduce(buffer.detach().to(torch.float32).cpu().numpy(),
                          onebit.OnebitState(w.numpy(), s.numpy(), state.block_size), n,
                          scatter, gather)
    if w is not worker:
        worker.copy_(w)
        server.copy_(s)
    return torch_work.done(buffer.copy_(
        torch.from_numpy(total[:buffer.numel()]).view(buffer.shape)))


class TopKHookState:
    """topk_hook's state: the process group, the share of each bucket's values sent
    (ratio; momentum and warmup_steps: DGC's options, as Compression.topk takes them: with
    momentum, the optimizer is SGD without momentum), and per bucket a Top-K compressor
    carrying its residual, with the layout it was made for (the shapes of the bucket's
    parameters). state_dict() / load_state_dict()
    save and restore the residuals with a checkpoint; a bucket whose layout differs from
    its saved residual's (DDP rebuilds its buckets once after the first step) starts again
    from zeros, as OnebitHookState's buffers do."""

    def __init__(self, process_group: Any = None, ratio: float = 0.01, momentum: float = 0.0,
                 warmup_steps: int = 0):
        self.process_group = process_group
        self.ratio = topk.check_ratio(ratio)
        self.momentum = topk.check_momentum(momentum)
        self.warmup_steps = topk.check_warmup(warmup_steps)
        #: bucket index -> (layout, its compressor)
        self.compressors: dict[int, tuple[tuple, topk.TopKCompressor]] = {}

    def _compressor(self, bucket: dist.GradBucket) -> topk.TopKCompressor:
        layout = tuple(tuple(p.shape) for p in bucket.parameters())
        found = self.compressors.get(bucket.index())
        if found is None or found[0] != layout:
            found = (layout, topk.TopKCompressor(self.ratio, self.momentum, self.warmup_steps))
            self.compressors[bucket.index()] = found
        return found[1]

    def state_dict(self) -> dict:
        return {"ratio": self.ratio, "momentum": self.momentum,
                "warmup_steps": self.warmup_steps,
                "residuals": {i: (layout, c.state_dict())
                              for i, (layout, c) in self.compressors.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.ratio = topk.check_ratio(state["ratio"])
        self.momentum = topk.check_momentum(state.get("momentum", 0.0))
        self.warmup_steps = topk.check_warmup(state.get("warmup_steps", 0))
        self.compressors = {}
        for i, (layout, saved) in state["residuals"].items():
            compressor = topk.TopKCompressor(self.ratio, self.momentum, self.warmup_steps)
            compressor.load_state_dict(saved)
            self.compressors[int(i)] = (tuple(map(tuple, layout)), compressor)


def topk_hook(state: TopKHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Average the bucket's largest values with error feedback (state.ratio of them)."""
    if not isinstance(state, TopKHookState):
        raise TypeError(f"state: expected a TopKHookState, got {type(state).__name__}")
    group, buffer = _group(state.process_group), bucket.buffer()
    compressor = state._compressor(bucket)
    ours = _ours(group)
    if ours is not None:
        return torch_work.future(api.allreduce_async_(buffer, ReduceOp.Average,
                                                    compression=compressor, comm=ours.comm))
    # another backend's group: the pairs through its allgather, summed here in rank order
    mine = compressor.bind().select(buffer.detach().to(torch.float32).cpu().numpy())
    total = topk.summed(_gather_rows(torch.from_numpy(mine), group), buffer.numel())
    kernels.divide(total, "float32", group.size())
    return torch_work.done(buffer.copy_(torch.from_numpy(total).view(buffer.shape)))
