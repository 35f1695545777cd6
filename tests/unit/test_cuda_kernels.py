"""The CUDA kernels (csrc/cuda/*.cu through collectives/kernels/cuda.py) checked against the
shared vectors (tests/vectors/kernels.npz) that the C++ kernels are checked against.

Runs wherever CuPy sees a GPU; elsewhere every test is skipped with the reason. (CI without
a GPU still compiles the .cu files: ci/compile_cuda.sh.)"""

from __future__ import annotations

import numpy as np
import pytest

from collectives import kernels as K
from collectives.ops import ReduceOp

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda12x): "
                                          "the CUDA kernels run through it")


def _gpus() -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


if _gpus() == 0:
    pytest.skip("no CUDA GPU visible to CuPy: the CUDA kernels need one to run",
                allow_module_level=True)

from kernel_vectors import reduce_case, ref, same_results, vectors  # noqa: E402


def _host(x) -> np.ndarray:
    return cupy.asnumpy(x)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


def _block(case: dict) -> int | None:
    return int(case["block"]) or None


@pytest.mark.parametrize("op", ref.OPS)
@pytest.mark.parametrize("name", sorted(ref.cases(vectors, "reduce")))
def test_reduce_vectors(name, op):
    dtype, srcs, case = reduce_case(name)
    dev = [cupy.asarray(s) for s in srcs]
    dst = cupy.empty_like(dev[0])
    K.reduce(dst, dev, dtype, ReduceOp[op])
    assert same_results(_host(dst), case[op.lower()], dtype)
    K.reduce(dev[0], dev, dtype, ReduceOp[op])  # dst is srcs[0]
    assert same_results(_host(dev[0]), case[op.lower()], dtype)


@pytest.mark.parametrize("dtype", ref.DTYPES)
def test_reduce_folds_any_number_of_sources(dtype):
    """A launch folds up to four sources: one source, and longer lists folded on into dst."""
    rng = np.random.default_rng(5)
    for nsrc in (1, 5, 7, 8):
        srcs = [ref.random_values(rng, dtype, 3001) for _ in range(nsrc)]
        for op in ref.OPS:
            dst = cupy.empty(3001, srcs[0].dtype)
            K.reduce(dst, [cupy.asarray(s) for s in srcs], dtype, ReduceOp[op])
            assert same_results(_host(dst), ref.reduce(srcs, dtype, op), dtype), (nsrc, op)


@pytest.mark.parametrize("dtype", ref.DTYPES)
def test_divide_vectors(dtype):
    case = ref.cases(vectors, "divide")[dtype]
    for divisor, expected in zip(case["divisors"], case["out"], strict=True):
        buf = cupy.asarray(case["x"])
        K.divide(buf, dtype, int(divisor))
        assert same_results(_host(buf), expected, dtype), divisor


def test_reduce_rejects_bad_input():
    a = cupy.ones(4, cupy.float32)
    with pytest.raises(TypeError, match=r"srcs\[1\]"):
        K.reduce(a, [a, cupy.ones(4, cupy.float64)], "float32", ReduceOp.Sum)
    with pytest.raises(ValueError, match=r"srcs\[1\]: holds 3 elements, need 4"):
        K.reduce(a, [a, a[:3]], "float32", ReduceOp.Sum)
    with pytest.raises(ValueError, match="op"):
        K.reduce(a, [a, a], "float32", ReduceOp.Average)
    with pytest.raises(ValueError, match="divisor"):
        K.divide(a, "float32", 0)


@pytest.mark.parametrize("name", sorted(ref.cases(vectors, "pack")))
def test_pack_vectors(name):
    case = ref.cases(vectors, "pack")[name]
    scale = float(case["scale"])
    tensors = [cupy.asarray(case[f"in{k}"]) for k in range(len(case) - 2)]
    assert _same(_host(K.pack(tensors, scale=scale)), case["out"])
    back = [cupy.empty_like(t) for t in tensors]
    K.unpack(cupy.asarray(ref.pack([_host(t) for t in tensors], 1.0)), back, scale=scale)
    for t, b in zip(tensors, back, strict=True):
        assert _same(_host(b), ref.pack([_host(t)], scale).reshape(t.shape))


def test_fp16_vectors():
    case = ref.cases(vectors, "fp16")["special"]
    h = _host(K.quantize_fp16(cupy.asarray(case["x"])))
    assert np.array_equal(h.view(np.uint16), case["h"].view(np.uint16))
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    wide = _host(K.dequantize_fp16(cupy.asarray(every)))
    assert np.array_equal(wide.view(np.uint32), K.dequantize_fp16(every).view(np.uint32))


@pytest.mark.parametrize("name", sorted(ref.cases(vectors, "int8")))
def test_int8_vectors(name):
    case = ref.cases(vectors, "int8")[name]
    q, scales = K.quantize_int8(cupy.asarray(case["x"]))
    assert _same(_host(q), case["q"]) and _same(_host(scales), case["scales"])
    assert _same(_host(K.dequantize_int8(q, scales, q.size)), case["out"])


@pytest.mark.parametrize("name", sorted(ref.cases(vectors, "onebit")))
def test_onebit_vectors(name):
    case = ref.cases(vectors, "onebit")[name]
    block = _block(case)
    error = cupy.asarray(case["error_in"])
    bits, scale = K.onebit_compress(cupy.asarray(case["x"]), error, block)
    assert _same(_host(bits), case["bits"])
    expected = case["scales"] if block else case["scales"][0]
    assert np.allclose(_host(scale), expected, rtol=1e-6, atol=0, equal_nan=True)
    assert np.allclose(_host(error), case["error_out"], rtol=0, atol=1e-6, equal_nan=True)
    out = K.onebit_decompress(cupy.asarray(case["bits"]), cupy.asarray(case["scales"]),
                              case["x"].size, block)
    assert _same(_host(out), case["decompressed"])


@pytest.mark.parametrize("name", sorted(ref.cases(vectors, "accumulate")))
def test_onebit_accumulate_vectors(name):
    case = ref.cases(vectors, "accumulate")[name]
    chunks = sum(f.startswith("bits") for f in case)
    acc = cupy.asarray(case["acc_in"])
    K.onebit_accumulate(acc, [cupy.asarray(case[f"bits{k}"]) for k in range(chunks)],
                        [cupy.asarray(case[f"scales{k}"]) for k in range(chunks)], acc.size,
                        _block(case))
    assert _same(_host(acc), case["acc_out"])


def test_torch_cuda_tensors_zero_copy():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    x, error = torch.randn(1001, device="cuda"), torch.zeros(1001, device="cuda")
    bits, scale = K.onebit_compress(x, error, 100)
    assert bits.device == x.device and scale.shape == (11,)
    back = K.onebit_decompress(bits, scale, 1001, 100)
    assert torch.allclose(error, x - back)
    tensors = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in (0, 3, 500)]
    packed = K.pack(tensors, scale=0.5)
    assert packed.dtype == torch.bfloat16 and packed.device == x.device
    assert torch.equal(packed, (torch.cat(tensors).float() * 0.5).bfloat16())
    a, b = (torch.randn(1001, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    K.reduce(out, [a, b], "bfloat16", ReduceOp.Sum)
    assert torch.equal(out, a + b)
    K.divide(out, "bfloat16", 3)
    assert torch.equal(out, ((a + b).float() / 3).bfloat16())
