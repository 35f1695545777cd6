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
