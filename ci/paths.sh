#!/usr/bin/env bash
# The numeric suites again on the CPU's baseline code paths: torch and NumPy pick SIMD
# kernels by CPU (AVX-512 and AMX on one machine, AVX2 on another), and those add in other
# orders, so a tolerance that only holds for one CPU's kernels fails here rather than on a
# user's machine. One pass with both libraries held to their baselines at once, as an older
# CPU holds both: torch on its default kernels (ATEN_CPU_CAPABILITY=default, MKL and oneDNN
# held to SSE4.2), NumPy without every SIMD group this CPU has beyond its baseline
# (NPY_DISABLE_CPU_FEATURES), OpenBLAS on its generic kernels. The suites: the unit tests
# that compare floating-point results with a reference, and tests/mpi at np 2 and 3 less
# what is exact on any path (test_collectives' integer-valued data, the shared-memory
# pipeline's own kernels, test_large) and torch.compile's inductor kernels. Cost: about 2
# minutes.
set -eu
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
numeric_unit="tests/unit/test_kernels.py tests/unit/test_compression.py tests/unit/test_dtypes.py
              tests/unit/test_store_choice.py tests/unit/test_select.py tests/unit/test_calibrate.py
              tests/unit/test_simulate.py"
# (not test_compile: inductor writes its own kernels, and with ATEN_CPU_CAPABILITY=default
# it emits vector code that the headers it then compiles against leave undeclared)
numeric_mpi="not test_large and not test_shm and not test_compile and (not test_collectives or random_floats)"
# NumPy's dispatched SIMD groups that this CPU has (the baseline cannot be turned off)
numpy_simd=$("$py" -c 'from numpy._core import _multiarray_umath as m
print(" ".join(f for f in m.__cpu_dispatch__ if m.__cpu_features__.get(f)))')
paths=(ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41
       NPY_DISABLE_CPU_FEATURES="$numpy_simd" OPENBLAS_CORETYPE=Prescott)
echo "== numeric suites on torch's and NumPy's baseline code paths: ${paths[*]}"
# shellcheck disable=SC2086
env "${paths[@]}" "$py" -m pytest -q -p no:cacheprovider --color=no $numeric_unit
env "${paths[@]}" ci/mpitest.sh 2 "" -k "$numeric_mpi"
env "${paths[@]}" ci/mpitest.sh 3 "" -k "$numeric_mpi"
