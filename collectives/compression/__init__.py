"""Compression for allreduce and reducescatter, behind one interface.

A compressor has Horovod's per-tensor pair, compress(x) -> (x', ctx) before the collective
and decompress(x', ctx) after it; `allreduce(topo, x, op, algorithm, state)`, how an
allreduce of a floating host array moves under it; and `reducescatter(topo, x, counts, op,
algorithm)`, this rank's block of one. The call path (collectives/api/: allreduce.py,
join.py, compressed.py, reducescatter.py) uses only those two; compressors whose values add
up as they travel (none, fp16) run a plain collective on what compress() made, the others
override them:
  none   the array as it is
  fp16   float16 on the wire (half of float32's bytes), summed in float16 as it travels
  int8   int8 plus one float32 scale per block; quantized values cannot be added, so
         every rank's pair is allgathered and summed locally in rank order, or, where
         cheaper, reduced in two phases (twophase.py: bytes that do not grow with the
         ranks); reducescatter: each rank's block sent to its rank and summed there
  int4   the same with 4-bit values, two a byte, and shorter blocks
  1-bit  signs plus scales with error feedback: its own two-phase exchange, with the
         error buffers (state) held by the caller (onebit.py)
  topk   the largest entries as (index, value) pairs with error feedback, allgathered and
         summed in rank order; each compressor holds its vector's residual (topk.py)
Non-floating arrays are never compressed (as in Horovod).

The compression layer: base.py (the interface), this module (none, fp16, int8, int4),
twophase.py (the two-phase quantized allreduce), onebit.py (1-bit with error feedback; its
state is the caller's), topk.py (Top-K with error feedback; its residual is the
compressor's) and wire.py (the bytes a rank receives per form: `python -m collectives
bytes`).
May import: the leaves, kernels, runtime, algorithms, auto."""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives import algorithms, kernels
from collectives.auto import select
from collectives.compression import twophase
from collectives.compression.base import Compressor
from collectives.compression.topk import TopKCompressor
from collectives.dtypes import FLOATING, NUMPY_NAMES, loaded_torch, torch_dtype, torch_dtype_name
from collectives.ops import KERNEL_OP, ReduceOp
from collectives.runtime.buffers import to_device, to_host
from collectives.runtime.topology import Topology


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


def _float_dtype(x: Any) -> str | None:
    """x's dtype name if x is a NumPy or CuPy array or torch tensor of a floating dtype,
    else None: only those are compressed."""
    if isinstance(x, np.ndarray) or _is_cupy(x):
        name = NUMPY_NAMES.get(np.dtype(x.dtype))
    elif (torch := loaded_torch()) is not None and isinstance(x, torch.Tensor):
        name = torch_dtype_name(x.dtype)
    else:
        return None
    return name if name in FLOATING else None


def _cast(x: Any, dtype_name: str) -> Any:
    if isinstance(x, np.ndarray) or _is_cupy(x):
        return x.astype(dtype_name)
    return x.to(torch_dtype(dtype_name))


class TensorCompressor(Compressor):
    """Horovod's Compressor: a per-tensor compress/decompress pair around a plain
    allreduce. This one is the identity: the array travels as it is."""

    name = "none"

    def compress(self, x: Any) -> tuple[Any, Any]:
        return x, None

    def decompress(self, x: Any, ctx: Any) -> Any:
        return x

    def allreduce(self, topo: Topology, x: np.ndarray, op: ReduceOp, algorithm: str,
                  state: Any = None) -> np.ndarray:
        """compress, a plain allreduce of what travels, decompress. Device data (a CuPy
        array) is compressed and decompressed on the device; only what travels is staged."""
        sent, ctx = self.compress(x)
        host = to_host(sent)
        out = np.empty_like(host)
        algo = select.concrete(topo, "allreduce", algorithm, host.nbytes)
        algorithms.reduce(algo, topo, host, out, op, host.dtype.name)
        return self.decompress(to_device(out, sent), ctx)

    def reducescatter(self, topo: Topology, x: np.ndarray, counts: list[int], op: ReduceOp,
                      algorithm: str, state: Any = None) -> np.ndarray:
        """compress, a plain reducescatter of what travels, decompress this rank's block."""
        sent, ctx = self.compress(x)
        out = np.empty(counts[topo.rank], sent.dtype)
        algo = select.concrete(topo, "reducescatter", algorithm, sent.nbytes)
        algorithms.reducescatter(algo, topo, sent, out, counts, KERNEL_OP[op], sent.dtype.name)
        algorithms.average(out, sent.dtype.name, op, topo.size)
        return self.decompress(out, ctx)


class FP16Compressor(TensorCompressor):
    """Floating arrays travel as float16 (half of float32's bytes); others are untouched."""

    name = "fp16"

    def compress(self, x: Any) -> tuple[Any, Any]:
        dtype = _float_dtype(x)
        if dtype is None:
            return x, None
        if dtype == "float32":  # our kernel: NumPy's cast is scalar, ~10x slower
            return kernels.quantize_fp16(x), dtype
        return _cast(x, "float16"), dtype

    def decompress(self, x: Any, ctx: Any) -> Any:
        if ctx == "float32":
            return kernels.dequantize_fp16(x)
        return x if ctx is None else _cast(x, ctx)


class BlockQuantizer(TensorCompressor):
    """Floating arrays travel as `bits`-bit integers with one float32 scale per block of
    `block` elements (int8, int4). Sum and Average only: quantized values are summed after
    they travel, in one of two forms (twophase.py): every rank's vector allgathered and
    summed locally, or two phases (an alltoall of chunks, each reduced in float32 by its
    rank and quantized again, then an allgather), whose bytes per rank do not grow with the
    ranks; `form` "auto" takes the cheaper by the modelled cost, the same on every rank.

    form: "auto", "allgather" or "two-phase"; a compressor with a fixed form is named after
    it (Int8Compressor("two-phase") is Compression.int8/two-phase in the call's agreement,
    so ranks that choose differently get a MismatchError, not a hang)."""

    ops = (ReduceOp.Sum, ReduceOp.Average)
    #: value bits, elements per scale; on_device: whether device data is quantized where it
    #: is (else it is staged through the host first)
    bits: int
    block: int
    on_device: bool = False

    def __init__(self, form: str = "auto"):
        if form not in ("auto", *twophase.FORMS):
            raise ValueError(f"form: expected 'auto' or one of {list(twophase.FORMS)}, "
                             f"got {form!r}")
        self.form = form
        if form != "auto":
            self.name = f"{type(self).name}/{form}"

    def quantize(self, x: Any) -> tuple[Any, Any]:
        """A flat float32 vector -> (payload, float32 scales)."""
        raise NotImplementedError

    def dequantize(self, q: Any, scales: Any, count: int, out: Any = None) -> Any:
        """The float32 vector of count elements of (q, scales), into out if given."""
        raise NotImplementedError

    def payload_bytes(self, count: int) -> int:
        return (count * self.bits + 7) // 8

    def compress(self, x: Any) -> tuple[Any, Any]:
        dtype = _float_dtype(x)
        if dtype is None:
            return x, None
        if isinstance(x, np.ndarray) or _is_cupy(x):
            flat = x.reshape(-1).astype(np.float32, copy=False)
            if _is_cupy(x) and not self.on_device:
                flat = to_host(flat)
        else:
            flat = x.detach().float().reshape(-1)
            if flat.device.type != "cpu" and not self.on_device:
                flat = flat.cpu()
        q, scales = self.quantize(flat)
        return q, (scales, tuple(x.shape), dtype)

    def decompress(self, x: Any, ctx: Any) -> Any:
        if ctx is None:
            return x
        scales, shape, dtype = ctx
        out = self.dequantize(x, scales, int(np.prod(shape, dtype=np.int64)))
        return _cast(out.reshape(shape), dtype)

    def allreduce(self, topo: Topology, x: np.ndarray, op: ReduceOp, algorithm: str,
                  state: Any = None) -> np.ndarray:
        """In the form `form` names or `auto` chooses (twophase.choose). Device data stays
        on the device in the allgather form of a compressor with device kernels; else it is
        staged through the host."""
        form = self.form if self.form != "auto" else twophase.choose(topo, self, x.size)
        if form == "allgather" and (self.on_device or isinstance(x, np.ndarray)):
            return self.allgathered(topo, x, op, algorithm)
        host = to_host(x).reshape(-1).astype(np.float32, copy=False)
        if form == "allgather":
            out = self.allgathered(topo, host, op, algorithm)
        else:
            out = twophase.allreduce(topo, self, host, op, algorithm)
        return to_device(out, x)

    def allgathered(self, topo: Topology, x: Any, op: ReduceOp, algorithm: str) -> Any:
        """Every rank's compress(x) allgathered; each rank decompresses and sums them in
        rank order, so results are bit-identical everywhere. Bytes received per rank:
        (n-1) m b/8 (+ scales), against a float32 ring's 2(n-1)/n 4m: for int8 cheaper up
        to 8 ranks, but growing with them (the two-phase form does not)."""
        n = topo.size
        q, (scales, shape, _) = self.compress(x)
        gathered = []
        for mine in (q, scales):  # on the device for device data: only these are staged
            host = to_host(mine)
            everyone = np.empty((n, host.size), host.dtype)
            algo = select.concrete(topo, "allgather", algorithm, everyone.nbytes)
            algorithms.allgather(algo, topo, host, everyone.reshape(-1), [host.size] * n)
            gathered.append(to_device(everyone, mine))
        return self.combine(*gathered, shape, op, topo.size)

    def reducescatter(self, topo: Topology, x: np.ndarray, counts: list[int], op: ReduceOp,
                      algorithm: str, state: Any = None) -> np.ndarray:
        """Each block of x compressed on its own and sent to its rank (alltoall); each rank
        decompresses and sums the blocks it received in rank order. Bytes received per
        rank: (n-1)(b bits + scales) for a block of b elements, against (n-1) b float32:
        one phase, whose bytes do not grow with the ranks. On even nodes of several ranks,
        a float32 node level first (twophase.reducescatter): L times fewer bytes cross the
        links."""
        if twophase.two_levels(topo) and twophase.even_nodes(topo):
            return twophase.reducescatter(topo, self, x.astype(np.float32, copy=False),
                                          counts, op)
        n, r = topo.size, topo.rank
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        pairs = [self.quantize(x[starts[j]:starts[j + 1]].astype(np.float32, copy=False))
                 for j in range(n)]
        received = []
        for k in (0, 1):
            send_counts = [p[k].size for p in pairs]
            send = np.concatenate([p[k] for p in pairs])
            recv = np.empty(n * send_counts[r], send.dtype)
            algo = select.concrete(topo, "alltoall", algorithm if algorithm in
                                   algorithms.ALLTOALL_ALGORITHMS else "auto", recv.nbytes)
            algorithms.alltoall(algo, topo, send, recv, send_counts, [send_counts[r]] * n)
            received.append(recv.reshape(n, send_counts[r]))
        return self.combine(*received, (counts[r],), op, n)

    def combine(self, all_q: np.ndarray, all_scales: np.ndarray, shape: tuple, op: ReduceOp,
                ranks: int) -> np.ndarray:
        """The float32 reduction of every rank's compress() pair (row r of all_q and
        all_scales: rank r's), decompressed and summed in rank order, so the same bytes give
        the same bits on every rank. Average divides as algorithms.average does (by ranks
        less those that joined the call running on the engine): for calls on the engine."""
        total = self.decompress(all_q[0], (all_scales[0], shape, "float32"))
        for r in range(1, all_q.shape[0]):
            part = self.decompress(all_q[r], (all_scales[r], shape, "float32"))
            kernels.reduce(total, [total, part], "float32", ReduceOp.Sum)
        algorithms.average(total, "float32", op, ranks)
        return total


class Int8Compressor(BlockQuantizer):
    """int8 with one float32 scale per block of kernels.INT8_BLOCK_SIZE elements (about a
    quarter of float32's bytes); its kernels also run on the device."""

    name = "int8"
    bits, block, on_device = 8, kernels.INT8_BLOCK_SIZE, True

    def quantize(self, x: Any) -> tuple[Any, Any]:
        return kernels.quantize_int8(x)

    def dequantize(self, q: Any, scales: Any, count: int, out: Any = None) -> Any:
        if isinstance(q, np.ndarray) and q.dtype == np.uint8:  # a packet's bytes
            q = q.view(np.int8)
        values = kernels.dequantize_int8(q, scales, count)
        if out is None:
            return values
        out[:] = values
        return out


class Int4Compressor(BlockQuantizer):
    """int4, two values a byte, with one float32 scale per block of kernels.INT4_BLOCK_SIZE
    elements (about an eighth of float32's bytes; each value within max|block| / 14).
    Host kernels: device data is staged through the host."""

    name = "int4"
    bits, block = 4, kernels.INT4_BLOCK_SIZE

    def quantize(self, x: Any) -> tuple[Any, Any]:
        return kernels.quantize_int4(x)

    def dequantize(self, q: Any, scales: Any, count: int, out: Any = None) -> Any:
        return kernels.dequantize_int4(q, scales, count, out)


def by_name(name: str) -> Compressor:
    """The compressor a call's agreed fields name (its `name`: "int8", "int8/two-phase",
    "topk/0.01"): how a joined rank takes part in a compressed call it did not make (a
    Top-K one with no residual of its own: it sends zeros)."""
    base, _, form = name.partition("/")
    if base == "topk":
        return Compression.topk(float(form))
    found = getattr(Compression, base)
    return type(found)(form) if form else found


def check_compression(compression: object) -> Compressor:
    """A collective's `compression` argument as the compressor of this call (None:
    Compression.none), in the caller's thread as the call is made: a Top-K compressor's
    bound call (TopKCompressor.bind: its warm-up's ratio for this call)."""
    if compression is None:
        return Compression.none
    if isinstance(compression, TopKCompressor):
        return compression.bind()
    if isinstance(compression, TensorCompressor):
        return compression
    raise ValueError(f"compression: expected Compression.none, fp16, int8, int4 or "
                     f"Compression.topk(ratio), got {compression!r}")


class Compression:
    """The available compressors (Horovod's names; topk makes one per vector, as it
    carries that vector's residual)."""

    none = TensorCompressor()
    fp16 = FP16Compressor()
    int8 = Int8Compressor()
    int4 = Int4Compressor()

    @staticmethod
    def topk(ratio: float = 0.01, momentum: float = 0.0,
             warmup_steps: int = 0) -> TopKCompressor:
        """A new Top-K compressor with error feedback sending the share ratio of each
        vector's entries (compression/topk.py). The default, 1%, needs neither of DGC's
        options (Lin et al., 2018, send 0.1% with both): momentum=m accumulates the
        inputs' momentum instead of the inputs (momentum correction: wrap plain SGD, the
        compressor adds the momentum), warmup_steps=W starts at a quarter of the entries
        and reaches ratio after W calls."""
        return TopKCompressor(ratio, momentum, warmup_steps)
