"""The C++ kernels behind collectives.kernels: reduce and divide, fused pack/unpack, fp16/int8/int4
quantization and 1-bit compression, checked against the NumPy reference (tests/vectors/make_kernel_vectors.py)
and the shared vectors it generated (tests/vectors/kernels.npz, also run on CUDA)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from kernel_vectors import reduce_case, ref, same_results, vectors

from collectives import _C, dtypes
from collectives import kernels as K
from collectives.ops import ReduceOp

f32 = np.float32


def _block(case: dict) -> int | None:
    return int(case["block"]) or None


def _onebit_bounds(x: np.ndarray, error: np.ndarray, scales, block: int | None):
    """(rtol of the scales, atol of the new error) between two float32 computations of
    1-bit compression that add in another order (the kernel's, NumPy's SIMD pairwise sum).
    A scale is the mean of k = block (or all) values |x + e|: k - 1 additions of
    non-negative terms and a division, each within one rounding (u = 2**-24) of the result,
    on each side: 2 (k + 1) u of it. The new error x + e - sign * scale carries a scale's
    difference and the rounding of its own two operations (2 u |x + e| each side)."""
    def largest(a) -> float:  # of the finite values: non-finite ones compare as NaN or inf
        a = np.abs(np.asarray(a, np.float64))
        return float(np.max(a[np.isfinite(a)], initial=0))

    u = 2.0 ** -24
    k = block or max(x.size, 1)
    rtol = 2 * (k + 1) * u
    return rtol, rtol * largest(scales) + 4 * u * largest(x.astype(np.float64) + error)


def _same(a, b) -> bool:
    """Equal values, dtype and NaN positions."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


def test_vectors_match_the_reference():
    fresh = ref.make_vectors()
    assert sorted(fresh) == sorted(vectors)
    for key, value in fresh.items():
        assert _same(value, vectors[key]), key


def test_int8_block_size_is_one_constant():
    assert K.INT8_BLOCK_SIZE == _C.INT8_BLOCK_SIZE == ref.INT8_BLOCK_SIZE
    assert vectors["meta.int8.block_size"] == K.INT8_BLOCK_SIZE
    assert K.INT4_BLOCK_SIZE == _C.INT4_BLOCK_SIZE == ref.INT4_BLOCK_SIZE
    assert vectors["meta.int4.block_size"] == K.INT4_BLOCK_SIZE


# ---- reduce / divide --------------------------------------------------------------------

def test_reference_dtypes_are_the_registry():
    assert ref.DTYPES == dtypes.NAMES
    assert all(ref.storage(d) == dtypes.STORAGE[d] for d in ref.DTYPES)


@pytest.mark.parametrize("op", ref.OPS)
@pytest.mark.parametrize("name", sorted(ref.cases(vectors, "reduce")))
def test_reduce_vectors(name, op):
    dtype, srcs, case = reduce_case(name)
    dst = np.empty_like(srcs[0])
    K.reduce(dst, srcs, dtype, ReduceOp[op])
    assert same_results(dst, case[op.lower()], dtype)
    acc = srcs[0].copy()  # dst is srcs[0]
    K.reduce(acc, [acc, *srcs[1:]], dtype, ReduceOp[op])
    assert same_results(acc, case[op.lower()], dtype)


@pytest.mark.parametrize("nsrc", [1, 5, 6])
@pytest.mark.parametrize("dtype", ref.DTYPES)
def test_reduce_matches_reference_past_the_vectors(dtype, nsrc):
    """One source, and more than the vectors' four, over more than one 2048-element block."""
    rng = np.random.default_rng(nsrc)
    srcs = [ref.random_values(rng, dtype, 5000) for _ in range(nsrc)]
    for op in ref.OPS:
        dst = np.empty_like(srcs[0])
        K.reduce(dst, srcs, dtype, ReduceOp[op])
        assert same_results(dst, ref.reduce(srcs, dtype, op), dtype), op


@pytest.mark.parametrize("case", sorted(ref.cases(vectors, "adam")))
def test_adam_update_vectors(case):
    """The fused update gives the reference's bits, NaN and inf included; m and v unchanged."""
    c = ref.cases(vectors, "adam")[case]
    lr, c1, sqrt_c2, eps, decay, bound = (float(x) for x in c["params"])
    p, m, v = (torch.from_numpy(c[k].copy()) for k in ("p", "m", "v"))
    K.adam_update(p, m, v, lr=lr, c1=c1, sqrt_c2=sqrt_c2, eps=eps, decay=decay, bound=bound)
    assert _same(p.numpy(), c["out"])
    assert _same(m.numpy(), c["m"]) and _same(v.numpy(), c["v"])


def test_adam_update_rejects_bad_input():
    p, m = np.ones(4, np.float32), np.ones(4, np.float32)
    with pytest.raises(ValueError, match="v: has 3 elements, p has 4"):
        K.adam_update(p, m, m[:3], lr=1e-3, eps=1e-8)
    with pytest.raises(TypeError, match="m: expected float32"):
        K.adam_update(p, m.astype(np.float64), m, lr=1e-3, eps=1e-8)
    with pytest.raises(ValueError, match="bound"):
        K.adam_update(p, m, m, lr=1e-3, eps=1e-8, bound=-1.0)


@pytest.mark.parametrize("dtype", ref.DTYPES)
def test_divide_vectors(dtype):
    case = ref.cases(vectors, "divide")[dtype]
    for divisor, expected in zip(case["divisors"], case["out"], strict=True):
        buf = case["x"].copy()
        K.divide(buf, dtype, int(divisor))
        assert same_results(buf, expected, dtype), divisor


@pytest.mark.parametrize("dtype", ref.DTYPES)
def test_divide_by_powers_of_two_matches_reference(dtype):
    """Powers of two divide by a multiply (floats) or a shift (integers): the reference's
    correctly rounded or floor division all the same, specials and subnormals included."""
    rng = np.random.default_rng(4)
    x = np.concatenate([ref.random_values(rng, dtype, 3000), *[
        ref.cases(vectors, "divide")[dtype]["x"]] * 2])
    for divisor in (4, 8, 64, 256, 1 << 20, 1 << 30):
        if x.dtype.kind in "iu" and divisor > np.iinfo(x.dtype).max:
            continue  # the divisor is converted to the element type (the reference's rule)
        buf = x.copy()
        K.divide(buf, dtype, divisor)
        assert same_results(buf, ref.divide(x, dtype, divisor), dtype), divisor


def _thp_eligible(address: int) -> bool | None:
    """/proc/self/smaps' THPeligible of the mapping holding address (None: not shown)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_advise_huge_pages_makes_fresh_memory_eligible(framework):
    """Where the kernel gives huge pages on request only (transparent_hugepage "madvise"),
    a large fresh buffer is eligible once advised (a torch tensor's was not before)."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[madvise]" not in mode.read_text():
        pytest.skip("transparent huge pages are not in madvise mode here")
    x = torch.empty(16 << 20) if framework == "torch" else np.empty(16 << 20, np.float32)
    address = (x.data_ptr() if framework == "torch" else x.ctypes.data) + (8 << 20)
    before = _thp_eligible(address)
    if before is None:
        pytest.skip("this kernel's smaps has no THPeligible")
    K.advise_huge_pages(x)
    assert _thp_eligible(address) is True
    if framework == "torch":  # NumPy advises its own large arrays; torch's CPU memory not
        assert before is False


# ---- pack / unpack ----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ref.cases(vectors, "pack")))
def test_pack_vectors(name):
    case = ref.cases(vectors, "pack")[name]
    tensors = [case[f"in{k}"] for k in range(len(case) - 2)]
    out = K.pack(tensors, scale=float(case["scale"]))
    assert _same(out, case["out"])
    back = [np.empty_like(t) for t in tensors]
    K.unpack(ref.pack(tensors, 1.0), back, scale=float(case["scale"]))
    for t, b in zip(tensors, back, strict=True):
        assert _same(b, ref.pack([t], float(case["scale"])).reshape(t.shape))


@pytest.mark.parametrize("dtype, scale", [(f32, 0.25), (np.float16, 0.5), (np.float16, 1.0),
                                          (np.int8, 1.0), (np.float64, 1.0)])
def test_pack_1000_tensors_of_every_size_into_a_larger_buffer(dtype, scale):
    """Over 4 MiB, so the streaming-store path runs, with tensors of odd byte lengths."""
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 12_000, 1000)
    sizes[::97] = 0
    tensors = [(rng.standard_normal(int(n)) * 50).astype(dtype).reshape(-1, 1) for n in sizes]
    buffer = np.full(sizes.sum() + 10, -1, dtype)
    out = K.pack(tensors, out=buffer, scale=scale)
    assert out.base is buffer and out.size == sizes.sum()
    assert _same(out, ref.pack(tensors, scale))
    assert (buffer[sizes.sum():] == -1).all()
    back = [np.zeros_like(t) for t in tensors]
    K.unpack(buffer, back, scale=1 / scale)
    expected = [ref.pack([ref.pack([t], scale)], 1 / scale).reshape(t.shape) for t in tensors]
    assert all(_same(b, e) for b, e in zip(back, expected, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int64, torch.int8])
def test_pack_torch_tensors(dtype):
    g = torch.Generator().manual_seed(1)
    tensors = [(torch.randn(n, 3, generator=g) * 50).to(dtype) for n in (0, 1, 7, 300)]
    tensors[1].requires_grad_(dtype.is_floating_point)
    scale = 0.5 if dtype.is_floating_point else 1.0
    out = K.pack(tensors, scale=scale)
    expected = torch.cat([t.detach().reshape(-1).float() for t in tensors]) * scale
    assert isinstance(out, torch.Tensor) and out.dtype == dtype
    assert torch.equal(out, expected.to(dtype))
    back = [torch.empty_like(t.detach()) for t in tensors]
    K.unpack(out, back, scale=1 / scale)
    assert all(torch.equal(b, t.detach()) for b, t in zip(back, tensors, strict=True))


def test_pack_nothing():
    assert _same(K.pack([]), np.empty(0, f32))
    K.unpack(np.empty(0, f32), [])


def test_pack_unpack_reject_bad_input():
    a, b = np.ones(4, f32), np.ones(4, np.float64)
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        K.pack([a, b])
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        K.pack([torch.ones(2), torch.ones(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"tensors\[1\].*contiguous"):
        K.pack([a, np.ones((4, 4), f32)[:, 0]])
    with pytest.raises(ValueError, match="out: holds 7 elements, need 8"):
        K.pack([a, a], out=np.empty(7, f32))
    with pytest.raises(TypeError, match="out"):
        K.pack([a], out=np.empty(4, np.float64))
    with pytest.raises(ValueError, match="scale"):
        K.pack([np.ones(3, np.int32)], scale=2.0)
    with pytest.raises(TypeError, match=r"tensors\[0\]"):
        K.pack([[1.0, 2.0]])
    with pytest.raises(TypeError, match=r"tensors\[0\]: unsupported dtype bool; expected"):
        K.pack([np.ones(3, bool)])
    with pytest.raises(TypeError, match=r"tensors\[0\]: unsupported dtype complex64"):
        K.pack([torch.ones(3, dtype=torch.complex64)])
    readonly = np.ones(4, f32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match=r"tensors\[0\]"):
        K.unpack(np.ones(4, f32), [readonly])
    with pytest.raises(ValueError, match="buffer: holds 4 elements, need 8"):
        K.unpack(np.ones(4, f32), [a, a.copy()])


# ---- fp16 / int8 ------------------------------------------------------------------------

def test_fp16_vectors():
    case = ref.cases(vectors, "fp16")["special"]
    h = K.quantize_fp16(case["x"])
    assert h.dtype == np.float16
    assert np.array_equal(h.view(np.uint16), case["h"].view(np.uint16))


def test_fp16_round_trips_every_half():
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    wide = K.dequantize_fp16(every)
    assert np.array_equal(wide.view(np.uint32), every.astype(f32).view(np.uint32))
    back = K.quantize_fp16(wide)
    number = ~np.isnan(every)  # NaNs come back as NaNs of the same sign, made quiet
    assert np.array_equal(back.view(np.uint16)[number], every.view(np.uint16)[number])
    assert np.isnan(back[~number]).all()
    assert np.array_equal(np.signbit(back), np.signbit(every))


def test_fp16_matches_numpy_on_random_bit_patterns():
    x = np.random.default_rng(4).integers(0, 2**32, 1 << 20, dtype=np.uint32).view(f32)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)
    h = K.quantize_fp16(x)
    number = ~np.isnan(x)
    assert np.array_equal(h.view(np.uint16)[number], expected.view(np.uint16)[number])
    assert np.isnan(h[~number]).all()


def test_fp16_keeps_shape_and_kind():
    x = torch.randn(3, 5)
    h = K.quantize_fp16(x)
    assert isinstance(h, torch.Tensor) and h.dtype == torch.float16 and h.shape == x.shape
    assert torch.equal(h, x.half())
    assert torch.equal(K.dequantize_fp16(h), x.half().float())


@pytest.mark.parametrize("name", sorted(ref.cases(vectors, "int8")))
def test_int8_vectors(name):
    case = ref.cases(vectors, "int8")[name]
    q, scales = K.quantize_int8(case["x"])
    assert _same(q, case["q"]) and _same(scales, case["scales"])
    assert _same(K.dequantize_int8(q, scales, q.size), case["out"])


def test_int8_error_bound():
    rng = np.random.default_rng(2)
    x = (rng.standard_t(2, 100_003) * 10.0 ** rng.integers(-20, 20, 100_003)).astype(f32)
    q, scales = K.quantize_int8(x)
    assert q.dtype == np.int8 and scales.size == -(-x.size // K.INT8_BLOCK_SIZE)
    back = K.dequantize_int8(q, scales, x.size)
    padded = np.zeros(scales.size * K.INT8_BLOCK_SIZE, f32)
    padded[: x.size] = np.abs(x)
    bound = np.repeat(padded.reshape(scales.size, -1).max(axis=1), K.INT8_BLOCK_SIZE)[: x.size]
    assert (np.abs(back - x) <= bound / 127).all()
    assert (np.abs(back - x) <= bound / 254 * 1.0001).all()


@pytest.mark.parametrize("name", sorted(ref.cases(vectors, "int4")))
def test_int4_vectors(name):
    case = ref.cases(vectors, "int4")[name]
    q, scales = K.quantize_int4(case["x"])
    assert _same(q, case["q"]) and _same(scales, case["scales"])
    assert _same(K.dequantize_int4(q, scales, case["x"].size), case["out"])


def test_int4_packs_two_values_a_byte_low_nibble_first():
    x = np.array([1, -1, 7, -7, 0], f32)  # max 7: scale 1, the values as they are
    q, scales = K.quantize_int4(x)
    assert scales.tolist() == [1.0]
    assert q.tolist() == [0x01 | 0xF0, 0x07 | 0x90, 0x00]  # -1 is 0xF, -7 is 0x9
    assert K.dequantize_int4(q, scales, 5).tolist() == x.tolist()


def test_int4_error_bound():
    rng = np.random.default_rng(3)
    x = (rng.standard_t(2, 100_001) * 10.0 ** rng.integers(-20, 20, 100_001)).astype(f32)
    q, scales = K.quantize_int4(x)
    assert q.dtype == np.uint8 and q.size == 50_001
    assert scales.size == -(-x.size // K.INT4_BLOCK_SIZE)
    back = K.dequantize_int4(q, scales, x.size)
    padded = np.zeros(scales.size * K.INT4_BLOCK_SIZE, f32)
    padded[: x.size] = np.abs(x)
    bound = np.repeat(padded.reshape(scales.size, -1).max(axis=1), K.INT4_BLOCK_SIZE)[: x.size]
    assert (np.abs(back - x) <= bound / 14 * 1.0001).all()
    assert (np.abs(back - x) > bound / 28).any(), "int4's error is as coarse as 4 bits"
    out = np.full(x.size, np.nan, f32)
    assert K.dequantize_int4(q, scales, x.size, out=out) is out and _same(out, back)


def test_int4_rejects_bad_input():
    with pytest.raises(TypeError, match="x: expected float32"):
        K.quantize_int4(np.ones(3))
    q, scales = K.quantize_int4(np.ones(300, f32))
    with pytest.raises(ValueError, match="scales: holds 2 elements, need 3"):
        K.dequantize_int4(q, scales[:2], 300)
    with pytest.raises(ValueError, match="q: holds 150 elements, need 151"):
        K.dequantize_int4(q, scales, 301)
    with pytest.raises(TypeError, match="q: expected uint8"):
        K.dequantize_int4(q.view(np.int8), scales, 300)


def test_int8_rejects_bad_input():
    with pytest.raises(TypeError, match="x: expected float32"):
        K.quantize_int8(np.ones(3))
    q, scales = K.quantize_int8(np.ones(300, f32))
    with pytest.raises(ValueError, match="scales: holds 1 elements, need 2"):
        K.dequantize_int8(q, scales[:1], 300)
    with pytest.raises(ValueError, match="q: holds 300 elements, need 301"):
        K.dequantize_int8(q, scales, 301)
    with pytest.raises(ValueError, match="count"):
        K.dequantize_int8(q, scales, -1)
    with pytest.raises(TypeError, match="h: expected float16"):
        K.dequantize_fp16(np.ones(3, f32))


# ---- 1-bit ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ref.cases(vectors, "onebit")))
def test_onebit_vectors(name):
    case = ref.cases(vectors, "onebit")[name]
    block = _block(case)
    error = case["error_in"].copy()
    bits, scale = K.onebit_compress(case["x"], error, block)
    assert _same(bits, case["bits"])
    with np.errstate(invalid="ignore", over="ignore"):
        rtol, atol = _onebit_bounds(case["x"], case["error_in"], case["scales"], block)
    assert np.allclose(scale, case["scales"] if block else case["scales"][0], rtol=rtol,
                       atol=0, equal_nan=True)
    assert np.allclose(error, case["error_out"], rtol=0, atol=atol, equal_nan=True)
    count = case["x"].size
    assert _same(K.onebit_decompress(case["bits"], case["scales"], count, block),
                 case["decompressed"])


@pytest.mark.parametrize("name", sorted(ref.cases(vectors, "accumulate")))
def test_onebit_accumulate_vectors(name):
    case = ref.cases(vectors, "accumulate")[name]
    chunks = sum(f.startswith("bits") for f in case)
    acc = case["acc_in"].copy()
    K.onebit_accumulate(acc, [case[f"bits{k}"] for k in range(chunks)],
                        [case[f"scales{k}"] for k in range(chunks)], acc.size, _block(case))
    assert _same(acc, case["acc_out"])


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 1000, 16384 * 3 + 5])
@pytest.mark.parametrize("block", [None, 1, 5, 8, 256, 20000])
def test_onebit_matches_reference(count, block):
    rng = np.random.default_rng(count)
    x = rng.standard_normal(count).astype(f32)
    error = (rng.standard_normal(count) * 0.1).astype(f32)
    before = error.copy()
    expected_bits, expected_scales, expected_error = ref.onebit_compress(x, error, block)
    bits, scale = K.onebit_compress(x, error, block)
    assert bits.size == (count + 7) // 8
    assert _same(bits, expected_bits)
    rtol, atol = _onebit_bounds(x, before, expected_scales, block)
    assert np.allclose(scale, expected_scales if block else expected_scales[0], rtol=rtol,
                       atol=0)
    assert np.allclose(error, expected_error, rtol=0, atol=atol)
    assert _same(K.onebit_decompress(bits, scale, count, block),
                 ref.onebit_decompress(bits, np.atleast_1d(scale), count, block))


@pytest.mark.parametrize("count", [0, 1, 9, 2048, 2049, 16384 * 3 + 5, 1 << 20])
@pytest.mark.parametrize("block", [None, 3, 256, 2048, 5000])
def test_onebit_serve_equals_accumulate_then_compress(count, block):
    # fused where blocks fit tiles (256, 2048, small counts), materialized otherwise (3, 5000)
    rng = np.random.default_rng(count + 7)
    n = 3
    sources = [K.onebit_compress(rng.standard_normal(count).astype(f32),
                                 np.zeros(count, f32), block) for _ in range(n)]
    bits = [b for b, _ in sources]
    scales = [np.atleast_1d(sc) / f32(n) for _, sc in sources]
    error = (rng.standard_normal(count) * 0.1).astype(f32)
    acc = np.zeros(count, f32)
    K.onebit_accumulate(acc, bits, scales, count, block)
    expected_error = error.copy()
    expected_bits, expected_scales = K.onebit_compress(acc, expected_error, block)
    got_bits, got_scales = K.onebit_serve(bits, scales, error, block)
    assert _same(got_bits, expected_bits)
    assert _same(got_scales, expected_scales)
    assert _same(error, expected_error)


def test_onebit_error_feedback_loses_nothing():
    """Over steps, what was sent plus the error still owed equals what was given."""
    rng = np.random.default_rng(3)
    error = np.zeros(999, f32)
    given, sent = np.zeros(999), np.zeros(999)
    for _ in range(20):
        x = rng.standard_normal(999).astype(f32)
        bits, scales = K.onebit_compress(x, error, 100)
        given += x
        sent += K.onebit_decompress(bits, scales, 999, 100)
    assert np.allclose(sent + error, given, atol=1e-4)


def test_onebit_updates_torch_error_in_place():
    x, error = torch.randn(37), torch.zeros(37)
    alias = error
    bits, scale = K.onebit_compress(x, error)
    assert isinstance(bits, torch.Tensor) and bits.dtype == torch.uint8 and bits.numel() == 5
    assert scale.dtype == torch.float32 and scale.dim() == 0
    assert alias is error
    assert torch.allclose(error, x - K.onebit_decompress(bits, scale, 37))


def test_onebit_zero_and_empty():
    error = np.zeros(10, f32)
    bits, scale = K.onebit_compress(np.zeros(10, f32), error)
    assert scale == 0 and not error.any() and bits.tolist() == [255, 192]
    bits, scale = K.onebit_compress(np.zeros(0, f32), np.zeros(0, f32))
    assert bits.size == 0 and scale == 0 and isinstance(scale, np.float32)
    bits, scales = K.onebit_compress(np.zeros(0, f32), np.zeros(0, f32), 4)
    assert bits.size == 0 and scales.size == 0
    assert K.onebit_decompress(bits, 0.0, 0).size == 0


def test_onebit_nan_poisons_only_its_block():
    x = np.ones(16, f32)
    x[9] = np.nan
    error = np.zeros(16, f32)
    bits, scales = K.onebit_compress(x, error, 8)
    assert scales[0] == 1 and np.isnan(scales[1])
    assert bits.tolist() == [255, 0b10111111]
    assert not error[:8].any() and np.isnan(error[8:]).all()
    assert np.isnan(K.onebit_decompress(bits, scales, 16, 8)[8:]).all()


def test_onebit_rejects_bad_input():
    x = np.ones(10, f32)
    with pytest.raises(TypeError, match="error: expected float32"):
        K.onebit_compress(x, np.zeros(10))
    with pytest.raises(ValueError, match="error: has 9 elements"):
        K.onebit_compress(x, np.zeros(9, f32))
    with pytest.raises(ValueError, match="block_size"):
        K.onebit_compress(x, np.zeros(10, f32), 0)
    with pytest.raises(ValueError, match="error"):
        readonly = np.zeros(10, f32)
        readonly.flags.writeable = False
        K.onebit_compress(x, readonly)
    bits, scales = K.onebit_compress(x, np.zeros(10, f32), 4)
    with pytest.raises(ValueError, match="bits: holds 2 elements, need 3"):
        K.onebit_decompress(bits, scales, 17, 4)
    with pytest.raises(ValueError, match="scales: holds 3 elements, need 4"):
        K.onebit_decompress(bits, scales, 13, 4)
    with pytest.raises(TypeError, match="bits"):
        K.onebit_decompress(bits.astype(np.int8), scales, 10, 4)
    with pytest.raises(ValueError, match="scales: got 1 for 2"):
        K.onebit_accumulate(np.zeros(10, f32), [bits, bits], [scales], 10, 4)
    with pytest.raises(ValueError, match=r"scales\[1\]: holds 2"):
        K.onebit_accumulate(np.zeros(10, f32), [bits, bits], [scales, scales[:2]], 10, 4)
    with pytest.raises(ValueError, match="acc: holds 10 elements, need 11"):
        K.onebit_accumulate(np.zeros(10, f32), [bits], [scales], 11, 4)


def topk_reference(c: np.ndarray, k: int) -> np.ndarray:
    """The indices (ascending) of the k largest |c|, ties to the lower index, NaN largest:
    a stable full sort, the independent twin of the kernel's partial selection."""
    magnitude = np.where(np.isnan(c), np.inf, np.abs(c))
    return np.sort(np.argsort(-magnitude, kind="stable")[:k]).astype(np.int32)


@pytest.mark.parametrize("count", [0, 1, 2, 7, 1000, 65537])
@pytest.mark.parametrize("share", [0.0, 0.01, 0.5, 1.0])
def test_topk_feedback_matches_a_full_sort_and_loses_nothing(count, share):
    g = np.random.default_rng(count)
    for ties in (False, True):  # whole numbers: many equal magnitudes
        x = (g.integers(-5, 6, count) if ties else g.standard_normal(count)).astype(np.float32)
        residual = (g.standard_normal(count) if not ties else g.integers(-2, 3, count)) \
            .astype(np.float32)
        c = (x + residual).astype(np.float32)
        k = int(share * count)
        indices, values = K.topk_feedback(x, residual, k)
        assert indices.dtype == np.int32 and values.dtype == np.float32
        np.testing.assert_array_equal(indices, topk_reference(c, k))
        np.testing.assert_array_equal(values, c[indices])
        rest = c.copy()
        rest[indices] = 0
        np.testing.assert_array_equal(residual, rest)  # sent + residual == c, exactly
        out = np.zeros(count, np.float32)
        K.scatter_add(indices, values, out)
        np.testing.assert_array_equal(out + residual, c)


def test_topk_sends_nan_first_and_leaves_x_alone():
    x = np.array([3, -4, np.nan, 4, 1], np.float32)
    before, residual = x.copy(), np.zeros(5, np.float32)
    indices, values = K.topk_feedback(x, residual, 2)
    assert indices.tolist() == [1, 2] and values[0] == -4 and np.isnan(values[1])
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(residual, [3, 0, 0, 4, 1])


def test_topk_and_scatter_add_reject_bad_input():
    x, residual = np.ones(4, np.float32), np.zeros(4, np.float32)
    for k in (-1, 5, 1.5, True):
        with pytest.raises(ValueError, match=r"k: expected an int in \[0, 4\]"):
            K.topk_feedback(x, residual, k)
    with pytest.raises(ValueError, match="residual: expected 4 elements"):
        K.topk_feedback(x, np.zeros(3, np.float32), 1)
    with pytest.raises(TypeError, match="residual: expected float32"):
        K.topk_feedback(x, np.zeros(4), 1)
    with pytest.raises(ValueError, match=r"indices: expected each in \[0, 4\), got 4"):
        K.scatter_add(np.array([0, 4], np.int32), np.ones(2, np.float32), np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="indices: expected int32"):
        K.scatter_add(np.array([0]), np.ones(1, np.float32), np.zeros(4, np.float32))


def test_every_cuda_module_the_device_face_loads_is_a_source_file():
    """kernels/cuda.py compiles csrc/cuda/<name>.cu for each _module(name) it calls; the
    folder is args.CUDA_SOURCES (read without CuPy, which this test does not need)."""
    import re
    from pathlib import Path

    from collectives.kernels import args

    text = (Path(args.__file__).parent / "cuda.py").read_text()
    names = set(re.findall(r'_module\("(\w+)"\)', text)) | set(
        re.findall(r'_launch\("(\w+)"', text))
    assert names, "no _module/_launch calls found in kernels/cuda.py"
    missing = sorted(n for n in names if not (args.CUDA_SOURCES / f"{n}.cu").is_file())
    assert not missing, f"no {missing} in {args.CUDA_SOURCES}"
