"""The NumPy reference (tests/vectors/make_kernel_vectors.py) and the shared test vectors it
wrote, loaded once for the CPU and CUDA kernel tests alike."""

import importlib.util
from pathlib import Path

import numpy as np

VECTORS = Path(__file__).resolve().parents[1] / "vectors"


def _load_reference():
    spec = importlib.util.spec_from_file_location("make_kernel_vectors",
                                                  VECTORS / "make_kernel_vectors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ref = _load_reference()
vectors = dict(np.load(ref.PATH))


def same_results(got, expected, dtype: str) -> bool:
    """Equal storage dtype and shape, NaN exactly where expected has NaN, and every other
    element the same bits (so -0 is not +0). NaN payloads are not part of the contract:
    CUDA arithmetic returns its own canonical NaN."""
    got, expected = np.asarray(got), np.asarray(expected)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    nan = np.isnan(ref.as_float(expected, dtype))
    if not np.array_equal(np.isnan(ref.as_float(got, dtype)), nan):
        return False
    bits = np.dtype(f"u{got.dtype.itemsize}")
    return np.array_equal(got.view(bits)[~nan], expected.view(bits)[~nan])


def reduce_case(name: str) -> tuple[str, list[np.ndarray], dict[str, np.ndarray]]:
    """(dtype, sources, case) of the reduce vector named <dtype>_<n>src."""
    case = ref.cases(vectors, "reduce")[name]
    srcs = [case[f"in{k}"] for k in range(sum(f.startswith("in") for f in case))]
    return name.partition("_")[0], srcs, case
