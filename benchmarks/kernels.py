"""Throughput of the csrc kernels next to their NumPy/torch equivalents and memcpy.

    .venv/bin/python benchmarks/kernels.py            # 1000 tensors / 16M floats
    .venv/bin/python benchmarks/kernels.py --quick    # 1M floats, a few seconds

GB/s counts the uncompressed data (count * 4 bytes) once. memcpy is libc memmove of as
many bytes between two preallocated buffers; for pack/unpack it is the same tensors copied
to/from the same buffer (pack: np.concatenate(..., out=), one memcpy per tensor in C;
unpack: a Python loop of ctypes.memmove). Each
kernel's output is checked against its equivalent before it is timed, and the best of
several runs is reported. torch runs on one thread, as our kernels do."""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from collectives import kernels as K

f32 = np.float32


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up: page faults, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def memcpy(nbytes: int) -> Callable[[], object]:
    """libc memmove of nbytes between two preallocated buffers."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    return lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes)


def memcpy_each(buffer: np.ndarray, tensors: list[np.ndarray]) -> Callable[[], None]:
    """libc memmove of each tensor's slice of buffer into it (~0.6 us of Python per call)."""
    plan, offset = [], buffer.ctypes.data
    for t in tensors:
        plan.append((t.ctypes.data, offset, t.nbytes))
        offset += t.nbytes

    def run() -> None:
        for dst, src, n in plan:
            ctypes.memmove(dst, src, n)

    return run


@dataclass
class Case:
    kernel: str
    size: str
    nbytes: int
    ours: Callable[[], object]
    equivalent: str
    theirs: Callable[[], object] | None
    copy: Callable[[], object]
    check: bool = True  # compare ours() with theirs() before timing


# ---- NumPy equivalents ------------------------------------------------------------------

def numpy_unpack(buffer: np.ndarray, tensors: list[np.ndarray], scale: float) -> None:
    offset = 0
    for t in tensors:
        np.multiply(buffer[offset:offset + t.size], f32(scale), out=t)
        offset += t.size


def numpy_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    blocks = x.reshape(-1, K.INT8_BLOCK_SIZE)  # benchmark sizes are whole blocks
    scales = np.abs(blocks).max(axis=1) / f32(127)
    return np.rint(blocks / scales[:, None]).astype(np.int8).reshape(-1), scales


def numpy_int4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    blocks = x.reshape(-1, K.INT4_BLOCK_SIZE)
    scales = np.abs(blocks).max(axis=1) / f32(7)
    v = np.rint(blocks / scales[:, None]).astype(np.int8).reshape(-1).view(np.uint8) & 0xF
    return v[0::2] | (v[1::2] << 4), scales


def numpy_onebit(x: np.ndarray, error: np.ndarray) -> tuple[np.ndarray, np.float32]:
    c = x + error
    scale = f32(np.linalg.norm(c) / np.sqrt(c.size))
    positive = c >= 0
    error[:] = c - np.where(positive, scale, -scale)
    return np.packbits(positive), scale


def numpy_decompress(bits: np.ndarray, scale: float, count: int) -> np.ndarray:
    return np.where(np.unpackbits(bits, count=count).astype(bool), f32(scale), f32(-scale))


# ---- cases ------------------------------------------------------------------------------

def tensor_sizes(n_tensors: int, total: int, rng: np.random.Generator) -> list[int]:
    """n_tensors sizes summing to about total, log-uniform like a model's parameters."""
    raw = np.exp(rng.uniform(0, np.log(total), n_tensors))
    return [max(1, int(s)) for s in raw / raw.sum() * total]


def cases(count: int, n_tensors: int) -> list[Case]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(count).astype(f32)
    sizes = tensor_sizes(n_tensors, count, rng)
    tensors = [rng.standard_normal(n).astype(f32) for n in sizes]
    total = sum(sizes)
    buf = np.empty(total, f32)
    torch_tensors = [torch.from_numpy(t) for t in tensors]
    torch_buf = torch.from_numpy(buf)
    outs = [np.empty_like(t) for t in tensors]
    h, (q, scales) = K.quantize_fp16(x), K.quantize_int8(x)
    q4, scales4 = K.quantize_int4(x)
    err_ours, err_np = np.zeros(count, f32), np.zeros(count, f32)
    bits, scale = K.onebit_compress(x, np.zeros(count, f32))
    chunks = [K.onebit_compress(rng.standard_normal(count).astype(f32), np.zeros(count, f32))
              for _ in range(4)]
    acc = np.zeros(count, f32)
    listed = f"{n_tensors} tensors, {total / 2**20:.1f}M"
    n = f"{count / 2**20:.0f}M" if count >= 2**20 else f"{count}"
    copy_in = lambda: np.concatenate(tensors, out=buf)  # noqa: E731
    copy_out = memcpy_each(buf, outs)
    vector = memcpy(count * 4)

    def accumulate_numpy():
        for b, s in chunks:
            acc[:] += numpy_decompress(b, s, count)

    return [
        Case("pack x0.5 (numpy)", listed, total * 4, lambda: K.pack(tensors, out=buf, scale=0.5),
             "np.concatenate*s", lambda: np.concatenate(tensors) * f32(0.5), copy_in),
        Case("pack x0.5 (torch)", listed, total * 4,
             lambda: K.pack(torch_tensors, out=torch_buf, scale=0.5),
             "torch.cat*s", lambda: torch.cat(torch_tensors) * 0.5, copy_in),
        Case("unpack x2", listed, total * 4, lambda: K.unpack(buf, outs, scale=2.0),
             "np.multiply loop", lambda: numpy_unpack(buf, outs, 2.0), copy_out, False),
        Case("quantize_fp16", n, count * 4, lambda: K.quantize_fp16(x),
             "astype(float16)", lambda: x.astype(np.float16), vector),
        Case("dequantize_fp16", n, count * 4, lambda: K.dequantize_fp16(h),
             "astype(float32)", lambda: h.astype(f32), vector),
        Case("quantize_int8", n, count * 4, lambda: K.quantize_int8(x),
             "numpy blocks", lambda: numpy_int8(x), vector),
        Case("dequantize_int8", n, count * 4, lambda: K.dequantize_int8(q, scales, count),
             "numpy blocks", lambda: q.reshape(-1, K.INT8_BLOCK_SIZE) * scales[:, None], vector,
             False),
        Case("quantize_int4", n, count * 4, lambda: K.quantize_int4(x),
             "numpy blocks", lambda: numpy_int4(x), vector),
        Case("dequantize_int4", n, count * 4, lambda: K.dequantize_int4(q4, scales4, count),
             "-", None, vector, False),
        Case("onebit_compress", n, count * 4, lambda: K.onebit_compress(x, err_ours),
             "numpy packbits", lambda: numpy_onebit(x, err_np), vector),
        Case("onebit_compress B=2048", n, count * 4,
             lambda: K.onebit_compress(x, err_ours, 2048), "-", None, vector, False),
        Case("onebit_decompress", n, count * 4, lambda: K.onebit_decompress(bits, scale, count),
             "numpy unpackbits", lambda: numpy_decompress(bits, scale, count), vector),
        Case("onebit_accumulate x4", n, 4 * count * 4,
             lambda: K.onebit_accumulate(acc, [b for b, _ in chunks], [s for _, s in chunks],
                                         count),
             "numpy loop", accumulate_numpy, memcpy(4 * count * 4), False),
    ]


def same(a, b) -> bool:
    """Equal outputs (scales to 1e-4: NumPy's float32 norm sums less exactly than ours)."""
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return all(np.allclose(np.asarray(u, f32), np.asarray(v, f32), rtol=1e-4, atol=1e-6)
               for u, v in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M floats, fewer repeats")
    args = parser.parse_args()
    count, repeats = (1 << 20, 3) if args.quick else (1 << 24, 7)
    torch.set_num_threads(1)
    header = (f"{'kernel':24} {'size':>20} {'ours GB/s':>10} {'equivalent':>18} "
              f"{'GB/s':>7} {'memcpy':>7} {'x equiv':>8} {'x memcpy':>9}")
    print(header)
    print("-" * len(header))
    for c in cases(count, 1000):
        if c.check:
            assert same(c.ours(), c.theirs()), f"{c.kernel}: differs from {c.equivalent}"
        t_ours = best_seconds(c.ours, repeats)
        t_theirs = best_seconds(c.theirs, repeats) if c.theirs else float("nan")
        t_copy = best_seconds(c.copy, repeats)
        gbs = [c.nbytes / t / 1e9 for t in (t_ours, t_theirs, t_copy)]
        print(f"{c.kernel:24} {c.size:>20} {gbs[0]:10.1f} {c.equivalent:>18} {gbs[1]:7.1f} "
              f"{gbs[2]:7.1f} {t_theirs / t_ours:8.2f} {t_copy / t_ours:9.2f}")


if __name__ == "__main__":
    main()
