"""NumPy reference of the csrc kernels, and the shared test vectors it generates.

    .venv/bin/python tests/vectors/make_kernel_vectors.py     # rewrites kernels.npz

The reference is the definition: plain NumPy, one line per step of each kernel's contract.
kernels.npz holds inputs and the reference's outputs under keys "<kernel>.<case>.<field>";
tests/unit/test_kernels.py (C++) and tests/unit/test_cuda_kernels.py (CUDA) check the
kernels against it, and test_kernels.py checks that this script still reproduces it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

INT8_BLOCK_SIZE = 256
INT4_BLOCK_SIZE = 128
SEED = 20240611
PATH = Path(__file__).with_name("kernels.npz")
f32 = np.float32


# ---- reference kernels ------------------------------------------------------------------

def pack(tensors: list[np.ndarray], scale: float) -> np.ndarray:
    """concat * scale; half types multiply in float32 and round once."""
    flat = np.concatenate([t.reshape(-1) for t in tensors])
    if scale == 1.0:
        return flat
    if flat.dtype == np.float16:
        return (flat.astype(f32) * f32(scale)).astype(np.float16)
    return flat * flat.dtype.type(scale)


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scale = max|x| / 127 per block; q = clamp(rint(x / scale)); NaN/inf block: scale NaN."""
    x = x.reshape(-1).astype(f32)
    nblocks = -(-x.size // INT8_BLOCK_SIZE)
    blocks = np.zeros(nblocks * INT8_BLOCK_SIZE, f32)
    blocks[: x.size] = x  # zero padding leaves max|x| unchanged
    blocks = blocks.reshape(nblocks, INT8_BLOCK_SIZE)
    amax = np.abs(blocks).max(axis=1, initial=f32(0))
    scales = np.where(np.isfinite(amax), amax / f32(127), f32(np.nan)).astype(f32)
    usable = scales > 0  # zero (or underflowed) and NaN scales give q = 0
    with np.errstate(invalid="ignore"):
        q = np.clip(np.rint(blocks / np.where(usable, scales, f32(1))[:, None]), -127, 127)
    q = np.where(usable[:, None], q, 0).astype(np.int8)
    return q.reshape(-1)[: x.size], scales


def dequantize_int8(q: np.ndarray, scales: np.ndarray, count: int) -> np.ndarray:
    return q[:count].astype(f32) * np.repeat(scales, INT8_BLOCK_SIZE)[:count]


def quantize_int4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scale = max|x| / 7 per block; v = clamp(rint(x / scale), -7, 7), packed two a byte
    (element 2k low nibble, 2k + 1 high); NaN/inf block: scale NaN, v = 0."""
    x = x.reshape(-1).astype(f32)
    nblocks = -(-x.size // INT4_BLOCK_SIZE)
    blocks = np.zeros(nblocks * INT4_BLOCK_SIZE, f32)
    blocks[: x.size] = x
    blocks = blocks.reshape(nblocks, INT4_BLOCK_SIZE)
    amax = np.abs(blocks).max(axis=1, initial=f32(0))
    scales = np.where(np.isfinite(amax), amax / f32(7), f32(np.nan)).astype(f32)
    usable = scales > 0
    with np.errstate(invalid="ignore"):
        v = np.clip(np.rint(blocks / np.where(usable, scales, f32(1))[:, None]), -7, 7)
    v = np.where(usable[:, None], v, 0).astype(np.int8).reshape(-1)[: x.size]
    nibbles = np.zeros(2 * ((x.size + 1) // 2), np.uint8)
    nibbles[: x.size] = v.view(np.uint8) & 0xF
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8), scales


def dequantize_int4(q: np.ndarray, scales: np.ndarray, count: int) -> np.ndarray:
    nibbles = np.stack([q & 0xF, q >> 4], axis=1).reshape(-1)[:count].astype(np.int8)
    values = np.where(nibbles > 7, nibbles - 16, nibbles).astype(f32)
    return values * np.repeat(scales, INT4_BLOCK_SIZE)[:count]


def _blocks(count: int, block_size: int | None) -> int:
    return max(count, 1) if block_size is None else block_size


def onebit_compress(
    x: np.ndarray, error: np.ndarray, block_size: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bits, scales, new error); scales has one entry (0 if empty) when block_size is None."""
    c = x + error
    block = _blocks(c.size, block_size)
    bits = np.packbits(c >= 0)
    scales = [np.sqrt(np.sum(np.square(c[lo:lo + block], dtype=np.float64)) /
                      c[lo:lo + block].size) for lo in range(0, c.size, block)]
    if block_size is None and c.size == 0:
        scales = [0.0]
    scales = np.array(scales, f32)
    with np.errstate(invalid="ignore"):  # inf - inf in a non-finite block
        return bits, scales, c - onebit_decompress(bits, scales, c.size, block_size)


def onebit_decompress(
    bits: np.ndarray, scales: np.ndarray, count: int, block_size: int | None
) -> np.ndarray:
    positive = np.unpackbits(bits, count=count).astype(bool)
    scale = np.repeat(np.asarray(scales, f32).reshape(-1), _blocks(count, block_size))[:count]
    return np.where(positive, scale, -scale)


def onebit_accumulate(acc, bits, scales, count, block_size) -> np.ndarray:
    acc = acc.copy()
    for b, s in zip(bits, scales, strict=True):
        acc[:count] += onebit_decompress(b, s, count, block_size)
    return acc


# dtype names as in collectives/dtypes.py; bfloat16 travels as its uint16 bits
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64",
          "int16")
INTEGERS = ("int8", "uint8", "int32", "int64", "int16")
OPS = ("Sum", "Min", "Max", "Product")


def storage(dtype: str) -> np.dtype:
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def bf16_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << np.uint32(16)).view(f32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even (overflow to inf); NaN stays NaN with its quiet bit set."""
    u = np.asarray(x, f32).view(np.uint32)
    rounded = (u + np.uint32(0x7fff) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (u >> np.uint32(16)) | np.uint32(0x40)
    return np.where((u & np.uint32(0x7fffffff)) > np.uint32(0x7f800000), nan, rounded
                    ).astype(np.uint16)


def _load_store(dtype: str):
    """(load, store): a dtype's storage to the type it computes in (float32 for the half
    types, itself otherwise) and back, rounding to nearest even."""
    if dtype == "float16":
        return (lambda h: h.astype(f32)), (lambda x: x.astype(np.float16))
    if dtype == "bfloat16":
        return bf16_to_f32, f32_to_bf16
    return (lambda x: x), (lambda x: x)


def _apply(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if op in ("Sum", "Product"):
        return _nan_of(a, b, a + b if op == "Sum" else a * b)  # integers wrap
    if op == "Min":  # a NaN operand wins (numpy.minimum); on a tie, b
        return np.where((a < b) | (a != a), a, b)
    return np.where((a > b) | (a != a), a, b)


def _nan_of(a: np.ndarray, b: np.ndarray, result: np.ndarray) -> np.ndarray:
    """result, with its NaNs' bits fixed (the kernels' contract leaves NaN payloads open; the
    vectors must not depend on the CPU): a's NaN, else b's, else (inf - inf, 0 * inf) the
    positive quiet NaN. Hardware differs here (x86 keeps the first operand's NaN and its
    default NaN is negative; NumPy's SIMD loops may swap the operands of a + b)."""
    if result.dtype.kind != "f":
        return result
    return np.where(a != a, a, np.where(b != b, b, np.where(result != result,
                                                            result.dtype.type(np.nan), result)))


def reduce(srcs: list[np.ndarray], dtype: str, op: str) -> np.ndarray:
    """srcs[0] op srcs[1] op ..., folded left to right; half types compute in float32 and
    round after every op, so a k-way fold equals k-1 pairwise reductions."""
    load, store = _load_store(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        acc = load(srcs[0])
        for src in srcs[1:]:
            acc = load(store(_apply(op, acc, load(src))))
        return store(acc)


def divide(x: np.ndarray, dtype: str, divisor: int) -> np.ndarray:
    """x / divisor, correctly rounded for floats (half types: in float32, rounded once);
    floor division for integers, the divisor first converted to the element type."""
    load, store = _load_store(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        wide = load(x)
        if wide.dtype.kind == "f":
            return store(wide / wide.dtype.type(divisor))
        return np.floor_divide(x, np.array(divisor).astype(x.dtype))


def as_float(x: np.ndarray, dtype: str) -> np.ndarray:
    """Values of a dtype's storage as floats (for NaN tests): bfloat16 bits decoded."""
    return bf16_to_f32(x) if dtype == "bfloat16" else x


# ---- vectors ----------------------------------------------------------------------------

COUNTS = (0, 1, 7, 8, 9, 255, 256, 257, 1037)


def _powers_of_ten(exponents: np.ndarray) -> np.ndarray:
    """10.0 ** k (float64) for each k, the same bits on every CPU: a table of decimal literals
    ("1e-8", which Python's float() rounds correctly), never NumPy's power, whose last bit
    depends on the SIMD loop the CPU selects (and so would the vectors built from it)."""
    lo = int(exponents.min(initial=0))
    table = np.array([float(f"1e{k}") for k in range(lo, int(exponents.max(initial=0)) + 1)])
    return table[exponents - lo]


def _special_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random floats salted with zeros, -0, tiny, subnormal, huge, inf and round-off ties."""
    x = (rng.standard_normal(n) * _powers_of_ten(rng.integers(-8, 6, n))).astype(f32)
    salt = np.array([0.0, -0.0, 1e-45, 3e-41, 6.1e-5, 5.96e-8, 2.98e-8, 65504, 65520, 1e6,
                     np.inf, -np.inf, 1.0009765625, 1.00048828125], f32)
    k = min(n, salt.size)
    x[rng.choice(n, k, replace=False)] = salt[:k]
    return x


def pack_vectors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    cases = {
        "f32": (np.float32, [0, 1, 7, 8, 9, 0, 1037, 3], 0.5),
        "f32_unit": (np.float32, [5, 0, 1001], 1.0),
        "f32_third": (np.float32, [1, 2, 3, 1000, 17], 1 / 3),
        "f16": (np.float16, [7, 9, 1037], 0.125),
        "f16_third": (np.float16, [31, 1], 1 / 3),
        "f64": (np.float64, [3, 1001], 0.25),
        "i32": (np.int32, [2, 0, 77], 1.0),
        "empty": (np.float32, [0, 0], 0.5),
    }
    for name, (dtype, sizes, scale) in cases.items():
        ts = [(rng.standard_normal(n) * 100).astype(dtype) for n in sizes]
        for k, t in enumerate(ts):
            out[f"pack.{name}.in{k}"] = t
        out[f"pack.{name}.scale"] = np.float64(scale)
        out[f"pack.{name}.out"] = pack(ts, scale)
    return out


def quantize_vectors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    fp16_x = np.concatenate([_special_values(rng, 1037), np.array([np.nan, -np.nan], f32)])
    out["fp16.special.x"] = fp16_x
    with np.errstate(over="ignore"):
        out["fp16.special.h"] = fp16_x.astype(np.float16)
    for n in COUNTS:
        x = (rng.standard_normal(n) * 3).astype(f32)
        out[f"int8.n{n}.x"] = x
    x = (rng.standard_normal(5 * INT8_BLOCK_SIZE) * 0.01).astype(f32)
    x[:INT8_BLOCK_SIZE] = 0  # all-zero block
    x[INT8_BLOCK_SIZE + 3] = np.nan  # NaN block
    x[2 * INT8_BLOCK_SIZE + 5] = -np.inf  # inf block
    x[3 * INT8_BLOCK_SIZE:4 * INT8_BLOCK_SIZE] *= f32(1e-38)  # subnormal and tiny values
    out["int8.special.x"] = x
    for key in [k for k in out if k.startswith("int8.")]:
        case = key.rsplit(".", 1)[0]
        q, scales = quantize_int8(out[key])
        out[f"{case}.q"], out[f"{case}.scales"] = q, scales
        out[f"{case}.out"] = dequantize_int8(q, scales, q.size)
    return out


def int4_vectors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """int4's cases: the counts of int8's, and blocks of special values, with an odd count
    (a half-filled last byte)."""
    out = {}
    for n in COUNTS:
        out[f"int4.n{n}.x"] = (rng.standard_normal(n) * 3).astype(f32)
    x = (rng.standard_normal(5 * INT4_BLOCK_SIZE + 3) * 0.01).astype(f32)
    x[:INT4_BLOCK_SIZE] = 0  # all-zero block
    x[INT4_BLOCK_SIZE + 3] = np.nan  # NaN block
    x[2 * INT4_BLOCK_SIZE + 5] = -np.inf  # inf block
    x[3 * INT4_BLOCK_SIZE:4 * INT4_BLOCK_SIZE] *= f32(1e-38)  # subnormal and tiny values
    x[4 * INT4_BLOCK_SIZE:4 * INT4_BLOCK_SIZE + 8] = [7, -7, 6.5, -6.5, 0.5, -0.5, 3.5, 2.5]
    out["int4.special.x"] = x
    for key in [k for k in out if k.startswith("int4.")]:
        case = key.rsplit(".", 1)[0]
        q, scales = quantize_int4(out[key])
        out[f"{case}.q"], out[f"{case}.scales"] = q, scales
        out[f"{case}.out"] = dequantize_int4(q, scales, out[key].size)
    return out


def onebit_vectors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    cases = [(f"n{n}", n, None) for n in COUNTS]
    cases += [("n1037_b1", 1037, 1), ("n1037_b3", 1037, 3), ("n1037_b8", 1037, 8),
              ("n1037_b100", 1037, 100), ("n1037_b5000", 1037, 5000), ("n9_b4", 9, 4),
              ("n0_b16", 0, 16)]
    for name, n, block in cases:
        x = rng.standard_normal(n).astype(f32)
        error = (rng.standard_normal(n) * 0.1).astype(f32)
        out.update(_onebit_case(name, x, error, block))
    # longer than the C++ kernel's chunk (16384): values on a coarse grid keep the file small
    for name, block in [("n20000_b1000", 1000), ("n20000_b24", 24), ("n20000", None)]:
        x = (rng.integers(-16, 16, 20000) / 8).astype(f32)
        error = (rng.integers(-4, 4, 20000) / 64).astype(f32)
        out.update(_onebit_case(name, x, error, block))
    zeros = np.zeros(100, f32)
    out.update(_onebit_case("zeros", zeros, zeros.copy(), None))
    out.update(_onebit_case("zeros_b8", zeros, zeros.copy(), 8))
    x = rng.standard_normal(100).astype(f32)
    x[[13, 14]] = [np.nan, -np.inf]
    out.update(_onebit_case("nan_b10", x, np.zeros(100, f32), 10))
    out.update(_onebit_case("nan", x, np.zeros(100, f32), None))
    for name, n, block, chunks in [("acc_n1037", 1037, None, 3), ("acc_n1037_b100", 1037, 100, 4),
                                   ("acc_n7_b3", 7, 3, 2), ("acc_n0", 0, None, 2)]:
        out.update(_accumulate_case(rng, name, n, block, chunks))
    return out


def _onebit_case(name: str, x: np.ndarray, error: np.ndarray, block: int | None) -> dict:
    bits, scales, new_error = onebit_compress(x, error, block)
    p = f"onebit.{name}."
    return {p + "x": x, p + "error_in": error, p + "block": np.int64(block or 0),
            p + "bits": bits, p + "scales": scales, p + "error_out": new_error,
            p + "decompressed": onebit_decompress(bits, scales, x.size, block)}


def _accumulate_case(rng, name: str, n: int, block: int | None, chunks: int) -> dict:
    acc = rng.standard_normal(n).astype(f32)
    bits, scales = [], []
    for _ in range(chunks):
        b, s, _ = onebit_compress(rng.standard_normal(n).astype(f32), np.zeros(n, f32), block)
        bits.append(b)
        scales.append(s)
    p = f"accumulate.{name}."
    out = {p + "acc_in": acc, p + "block": np.int64(block or 0),
           p + "acc_out": onebit_accumulate(acc, bits, scales, n, block)}
    for k in range(chunks):
        out[f"{p}bits{k}"], out[f"{p}scales{k}"] = bits[k], scales[k]
    return out


def _specials(dtype: str) -> np.ndarray:
    """Values whose every pairing a reduction must get right: signed zeros, ones, extremes,
    infinities and NaNs (floats); 0, ±1, ±2 and the range ends (integers: they wrap)."""
    if dtype in INTEGERS:
        info = np.iinfo(dtype)
        return np.array([0, 1, -1, 2, -2, info.min, info.max]).astype(dtype)
    big = {"float16": 65504.0, "bfloat16": 3.3895e38, "float32": 3.4028235e38,
           "float64": 1.7976931348623157e308}[dtype]
    tiny = {"float16": 5.96e-8, "bfloat16": 9.2e-41, "float32": 1e-45,
            "float64": 5e-324}[dtype]
    return _to(np.array([0.0, -0.0, 1.0, -1.0, 1.5, big, -big, tiny, -tiny, np.inf,
                         -np.inf, np.nan, -np.nan]), dtype)


def _to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values in a dtype's storage (rounded to nearest even)."""
    with np.errstate(over="ignore"):
        return f32_to_bf16(x.astype(f32)) if dtype == "bfloat16" else x.astype(dtype)


def random_values(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    """Values spread over a dtype's whole range, a quarter of them small integers."""
    if dtype in INTEGERS:
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    exp = {"float16": (-8, 5), "bfloat16": (-38, 38), "float32": (-38, 38),
           "float64": (-300, 300)}[dtype]
    x = rng.standard_normal(n) * _powers_of_ten(rng.integers(*exp, n))
    small = rng.random(n) < 0.25  # small integers: exact sums, ties between sources
    x[small] = rng.integers(-4, 5, small.sum())
    return _to(x, dtype)


def reduce_vectors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per dtype, 2, 3 and 4 sources and every op: the sources start with every pairing of
    the specials (the first two sources) and go on at random."""
    out = {}
    for dtype in DTYPES:
        special = _specials(dtype)
        grid = [np.repeat(special, special.size), np.tile(special, special.size)]
        for nsrc, n in ((2, 333), (3, 211), (4, 187)):  # each >= 13 * 13 specials
            srcs = [random_values(rng, dtype, n) for _ in range(nsrc)]
            for k in range(nsrc):
                srcs[k][:grid[0].size] = grid[k] if k < 2 else rng.choice(special, grid[0].size)
            p = f"reduce.{dtype}_{nsrc}src."
            out.update({f"{p}in{k}": src for k, src in enumerate(srcs)})
            out.update({p + op.lower(): reduce(srcs, dtype, op) for op in OPS})
    return out


def divide_vectors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per dtype, one vector (the specials, then random values) by several divisors."""
    out = {}
    for dtype in DTYPES:
        x = np.concatenate([_specials(dtype), random_values(rng, dtype, 333)])
        divisors = np.array([1, 2, 3, 7, 100], np.int64)
        p = f"divide.{dtype}."
        out[p + "x"], out[p + "divisors"] = x, divisors
        out[p + "out"] = np.stack([divide(x, dtype, int(d)) for d in divisors])
    return out


def adam_update(p: np.ndarray, m: np.ndarray, v: np.ndarray, lr: float, c1: float,
                sqrt_c2: float, eps: float, decay: float, bound: float) -> np.ndarray:
    """Each operation rounded to float32, no FMA: d = sqrt(v) / sqrt_c2 + eps;
    u = (m / c1) / d clamped to [-bound, bound] (NaN stays); p * decay - lr * u."""
    with np.errstate(all="ignore"):
        d = np.sqrt(v) / f32(sqrt_c2) + f32(eps)
        u = (m / f32(c1)) / d
        u = np.where(u < -f32(bound), -f32(bound), u)
        u = np.where(u > f32(bound), f32(bound), u)
        return p * f32(decay) - f32(lr) * u


def adam_vectors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Moments with zeros, tiny and huge variances and non-finite values, under each case's
    (lr, c1, sqrt_c2, eps, decay, bound): bias corrections, weight decay, a bound or none."""
    n = 1000
    special = np.array([0, 1e-30, 1e-45, 1e30, np.inf, np.nan], f32)
    p = rng.standard_normal(n).astype(f32)
    m = (rng.standard_normal(n) * 1e-2).astype(f32)
    v = (rng.standard_normal(n) * 1e-3).astype(f32) ** 2
    m[:6], v[6:12], m[12:18] = special, special, -special
    out = {}
    for name, params in {"plain": (1e-3, 1.0, 1.0, 1e-8, 1.0, np.inf),
                         "corrected": (3e-4, 0.271, 0.0447, 1e-8, 1.0, np.inf),
                         "bounded": (1e-2, 0.9, 0.3, 1e-6, 0.999, 3.1622777),
                         "decayed": (1e-3, 1.0, 1.0, 1e-8, 0.99, 1.0)}.items():
        k = f"adam.{name}."
        out[k + "p"], out[k + "m"], out[k + "v"] = p, m, v
        out[k + "params"] = np.array(params, np.float64)
        out[k + "out"] = adam_update(p, m, v, *params)
    return out


def make_vectors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    vectors = {"meta.int8.block_size": np.int64(INT8_BLOCK_SIZE),
               "meta.int4.block_size": np.int64(INT4_BLOCK_SIZE)}
    for part in (pack_vectors, quantize_vectors, onebit_vectors, reduce_vectors,
                 divide_vectors, adam_vectors, int4_vectors):
        vectors.update(part(rng))
    return vectors


def cases(vectors, kernel: str) -> dict[str, dict[str, np.ndarray]]:
    """{case: {field: array}} for one kernel's entries of a vectors mapping."""
    grouped: dict[str, dict[str, np.ndarray]] = {}
    for key in vectors:
        k, case, field = key.split(".")
        if k == kernel:
            grouped.setdefault(case, {})[field] = vectors[key]
    return grouped


if __name__ == "__main__":
    np.savez_compressed(PATH, **make_vectors())
    print(f"wrote {PATH} ({PATH.stat().st_size} bytes)")
