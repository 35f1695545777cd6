"""ZeroOptimizer's buckets (optim/zero.py): parameters of one dtype and device in one flat
buffer that their .data view, this rank's piece of it, and the reduce-scatter of their
gradients into that piece; stage 1-2's variant whose parameters are gathered quantized
(QuantizedBucket), and stage 3's, whose flat buffer holds memory only while gathered
(optim/zero3.py says when). Both keep this rank's piece in its own float32 tensor, the
master the optimizer steps, and gather with the same helpers (gather_start/gather_decode):
float16, or int8 or int4 with a scale per block, which every rank decodes alike, its own
piece included, so the replicas compute with identical parameters."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from collectives import api as C
from collectives import kernels as _kernels
from collectives.algorithms.onebit import scatter_error_size
from collectives.kernels.args import nblocks
from collectives.runtime.p2p import even_bounds, even_split

#: compression= for 1-bit gradients with error feedback (compressed_reducescatter).
ONEBIT = "onebit"


class Bucket:
    """Parameters of one dtype and device sharing one flat buffer; this rank's piece of it
    is [lo, hi), and `pieces` are its overlaps with the parameters."""

    __slots__ = ("params", "flat", "bounds", "lo", "hi", "pieces", "ready", "grad", "handle",
                 "error")
    #: the format the parameters are gathered in after a step (Compression.fp16, int8 or
    #: int4: QuantizedBucket), None: as they are
    quantized: Any = None

    def __init__(self, params: list[torch.Tensor], rank: int, size: int, onebit: bool):
        self.params = params
        starts, total = [], 0
        for p in params:
            starts.append(total)
            total += p.numel()
        self.flat = torch.empty(total, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for p, start in zip(params, starts):
                self.flat[start:start + p.numel()].copy_(p.reshape(-1))
                p.data = self.flat[start:start + p.numel()].view_as(p)
        self.bounds = bounds = even_bounds(total, size)  # every rank's piece
        self.lo, self.hi = bounds[rank], bounds[rank + 1]
        # (parameter, offset of the piece in the parameter, piece, its offset in [lo, hi)):
        # the pieces are views of flat
        self.pieces: list[tuple[torch.Tensor, int, torch.Tensor, int]] = []
        for p, start in zip(params, starts):
            a, b = max(start, self.lo), min(start + p.numel(), self.hi)
            if a < b:
                self.pieces.append((p, a - start, self.flat[a:b], a - self.lo))
        self.ready = 0
        self.grad: torch.Tensor | None = None
        self.handle: C.Handle | None = None
        # with 1-bit, the worker error: this rank's float32 buffer over every rank's piece
        self.error = torch.zeros(scatter_error_size(even_split(total, size))) if onebit \
            else None

    def piece(self) -> torch.Tensor:
        """This rank's piece as the optimizer steps it: the input of the gather after a
        step."""
        return self.flat[self.lo:self.hi]

    def _own_shard(self) -> None:
        """This rank's piece moved into a tensor of its own (`shard`), which the pieces
        view from now on: the flat buffer is then only what the parameters see."""
        self.shard = self.flat[self.lo:self.hi].clone()
        self.pieces = [(p, offset, self.shard[start:start + piece.numel()], start)
                       for p, offset, piece, start in self.pieces]

    def launch(self, process_set: Any, compression: Any, block_size: int | None,
               free_grads: bool) -> None:
        """Pack the gradients (zeros for a parameter without one) and start their
        reducescatter under compression (ONEBIT: compressed_reducescatter with this
        bucket's error buffer); free the parameters' .grad with free_grads (stage 2)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.grad = _kernels.pack(grads, torch.empty_like(self.flat))
        if compression == ONEBIT:
            self.handle = C.compressed_reducescatter_async(self.grad, self.error, block_size,
                                                           process_set=process_set)
        else:
            self.handle = C.reducescatter_async(self.grad, op=C.Average,
                                                compression=compression,
                                                process_set=process_set)
        if free_grads:
            for p in self.params:
                p.grad = None

    def finish(self) -> None:
        """Wait for the reducescatter; each piece's .grad is its part of this rank's piece of
        the averaged gradients."""
        mine = C.synchronize(self.handle)
        for _, _, piece, start in self.pieces:
            piece.grad = mine[start:start + piece.numel()]
        self.drop()

    def drop(self) -> None:
        """Forget this step's packed gradients and reduction (done, or abandoned)."""
        self.grad, self.handle, self.ready = None, None, 0


class QuantizedBucket(Bucket):
    """Stages 1 and 2 with parameter_compression (float32 buckets): this rank's piece in
    its own tensor (`shard`, the float32 master that the pieces view and the optimizer
    steps); after a step every rank decodes the gathered float16, int8 or int4 bytes into
    the flat buffer, its own piece included (ZeroOptimizer._gather_whole)."""

    __slots__ = ("shard", "quantized")

    def __init__(self, params: list[torch.Tensor], rank: int, size: int, onebit: bool,
                 quantized: Any):
        super().__init__(params, rank, size, onebit)
        self.quantized = quantized
        self._own_shard()

    def piece(self) -> torch.Tensor:
        return self.shard


def quantizes(dtype: torch.dtype, compression: Any) -> bool:
    """Whether parameters of dtype are gathered quantized under compression (float32 only:
    float16, or int8 or int4 with a scale per block)."""
    return dtype == torch.float32 and any(compression is c for c in (
        C.Compression.fp16, C.Compression.int8, C.Compression.int4))


def gather_start(shard: torch.Tensor, quantized: Any, process_set: Any,
                 out: np.ndarray | None = None) -> tuple[C.Handle, ...]:
    """Start the allgather of every rank's shard, quantized (Compression.fp16, int8 or int4:
    its values, and the scales of int8's or int4's blocks) or not (None: into out, if
    given). int4 sends two values a byte: a piece of n elements is (n + 1) // 2 bytes."""
    if quantized is C.Compression.int8 or quantized is C.Compression.int4:
        q, scales = quantized.quantize(shard)
        return (C.allgather_async(q, process_set=process_set),
                C.allgather_async(scales, process_set=process_set))
    if quantized is C.Compression.fp16:
        return (C.allgather_async(_kernels.quantize_fp16(shard), process_set=process_set),)
    return (C.allgather_async(shard, out=out, process_set=process_set),)


def gather_decode(parts: list[Any], quantized: Any, bounds: list[int]) -> torch.Tensor:
    """The whole flat buffer from gather_start's finished parts (bounds: every rank's
    piece); int8 and int4 pieces are decoded each with its own scales (blocks, and int4's
    byte pairs, restart per piece)."""
    if quantized is C.Compression.fp16:
        return _kernels.dequantize_fp16(parts[0])
    if quantized is not C.Compression.int8 and quantized is not C.Compression.int4:
        return parts[0]
    q, scales = parts
    out, at, s = [], 0, 0
    for a, b in zip(bounds, bounds[1:]):
        blocks = nblocks(b - a, quantized.block)
        size = ((b - a) * quantized.bits + 7) // 8  # int4: two values a byte
        if b > a:
            out.append(quantized.dequantize(q[at:at + size], scales[s:s + blocks], b - a))
        at, s = at + size, s + blocks
    return torch.cat(out) if out else torch.empty(0)


#: torch dtypes whose memory a NumPy array can view (bfloat16 has no NumPy twin).
_NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32,
                 torch.float64: np.float64}


class _Memory:
    """t's memory as NumPy sees it through __array_interface__, with t kept alive: an
    async gather writing into it outlives nothing it writes to, even if the bucket goes."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": (t.numel(),),
                                    "typestr": np.dtype(_NUMPY_DTYPES[t.dtype]).str,
                                    "version": 3}


def _unpinned_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy array over t's memory that leaves t's storage resizable (torch's own
    .numpy() fixes the storage's size for good): valid only until the storage is resized,
    which ShardedBucket.free() does after the gather that writes through it is finished."""
    return np.asarray(_Memory(t))


class ShardedBucket(Bucket):
    """A stage-3 bucket: this rank's piece in its own tensor (`shard`, which the pieces
    view and the optimizer steps); the flat buffer, which the parameters view, holds memory
    only while gathered (optim/zero3.py says when)."""

    __slots__ = ("shard", "nbytes", "gathered", "pending", "pending_format", "owner",
                 "quantized", "secondary", "node_bounds", "direct")

    def __init__(self, params: list[torch.Tensor], rank: int, size: int, onebit: bool,
                 quantized: Any = None):
        super().__init__(params, rank, size, onebit)
        # float32 parameters gathered as float16, or int8 or int4 with a scale per block
        self.quantized = quantized if quantizes(self.flat.dtype, quantized) else None
        self._own_shard()
        self.nbytes = self.flat.numel() * self.flat.element_size()
        self.gathered, self.pending, self.owner = True, None, None
        # what the pending gather's parts hold: the quantized format, or None (float32 values)
        self.pending_format: Any = None
        # whether the gather writes straight into the flat buffer (not decoded first, and
        # of a dtype NumPy has)
        self.direct = self.quantized is None and self.flat.dtype in _NUMPY_DTYPES
        # hpZ: this rank's piece of the unit among its node's ranks, kept from the forward
        # to the backward (None: none kept); node_bounds: the node's pieces
        self.secondary: torch.Tensor | None = None
        self.node_bounds: list[int] | None = None
        self.free()

    def keep_secondary(self, node_rank: int, node_size: int) -> None:
        """hpZ: keep this rank's node-local piece of the gathered unit for the backward's
        gather (the values the forward used, whatever the wire format)."""
        if self.node_bounds is None:
            self.node_bounds = even_bounds(self.flat.numel(), node_size)
        lo, hi = self.node_bounds[node_rank], self.node_bounds[node_rank + 1]
        self.drop_secondary()
        self.secondary = self.flat[lo:hi].clone()
        self.owner.held(self.secondary.numel() * self.secondary.element_size())

    def drop_secondary(self) -> None:
        """hpZ: give the kept piece back (used by the backward, or stale after a step)."""
        if self.secondary is not None:
            self.owner.held(-self.secondary.numel() * self.secondary.element_size())
            self.secondary = None

    def start(self) -> None:
        """Start the allgather of every rank's shard (quantized: its float16, int8 or int4
        values and the blocks' scales), or, with a secondary piece kept (hpZ), of the node's secondary
        pieces over the node alone; unless gathered or started. Unquantized, it writes into
        the flat buffer's memory, allocated now."""
        if self.gathered or self.pending is not None:
            return
        ps = self.owner.process_set
        out = None
        if self.direct:
            self._allocate()
            out = _unpinned_view(self.flat)
        if self.secondary is not None:  # the values the forward decoded: float32
            self.pending = (C.allgather_async(self.secondary, out=out,
                                              process_set=self.owner.node_set),)
            self.pending_format = None
        else:
            self.pending = gather_start(self.shard, self.quantized, ps, out)
            self.pending_format = self.quantized
        self.owner.held(self.nbytes)

    def gather(self) -> None:
        """The whole flat buffer, from every rank's shard (waiting for a started gather).
        Quantized, every rank decodes the same bytes, its own piece included, so the
        replicas compute with identical parameters; the shards stay float32."""
        if self.gathered:
            return
        self.start()
        parts = [C.synchronize(h) for h in self.pending]
        self.pending = None
        if not self.direct:
            full = gather_decode(parts, self.pending_format, self.bounds)
            self._allocate()
            with torch.no_grad():
                self.flat.copy_(full)
        self.gathered = True

    def _allocate(self) -> None:
        """Memory for the flat buffer again, which free() gave back."""
        self.flat.untyped_storage().resize_(self.nbytes)
        _kernels.advise_huge_pages(self.flat)  # fresh memory: fault it in by 2 MiB pages

    def free(self) -> None:
        """Give the flat buffer's memory back (a started gather is finished first: every
        rank issued it)."""
        if self.pending is not None:
            for h in self.pending:
                C.synchronize(h)
            self.pending = None
        elif not self.gathered:
            return
        self.flat.untyped_storage().resize_(0)
        self.gathered = False
        if self.owner is not None:
            self.owner.held(-self.nbytes)

    def launch(self, process_set: Any, compression: Any, block_size: int | None,
               free_grads: bool) -> None:
        """Stage 2's launch, then the unit's parameters freed: backward is done with them
        (and with the secondary piece)."""
        super().launch(process_set, compression, block_size, free_grads)
        self.free()
        self.drop_secondary()
