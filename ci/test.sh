#!/usr/bin/env bash
# The whole test suite (what `make test` and CI run): lint, CUDA compile check, unit tests,
# then tests/mpi under mpirun at np 1, 2, 3, 4 and with simulated nodes (2x2 and 2+1: the
# multi-node algorithms, and the agreement over messages, which one node runs in shared memory),
# then the numeric suites on torch's and NumPy's baseline code paths (ci/paths.sh).
set -eu
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
start=$(date +%s)
echo "== ruff check"
"$(dirname "$py")/ruff" check collectives optim tests benchmarks examples ci setup.py
if [ -x ci/compile_cuda.sh ]; then
  echo "== nvcc: compile every csrc/cuda/*.cu"
  ci/compile_cuda.sh
fi
echo "== tests/unit"
# Three test processes on two cores: most unit tests wait on jobs of their own (mpirun,
# the launcher, the rig), so a third keeps the cores busy. Tests that share one thing of
# the machine take turns on it (the rig: a lock in test_launcher.py).
"$py" -m pytest -q -p no:cacheprovider --color=no -n 3 --durations=40 tests/unit
ci/mpitest.sh 1
ci/mpitest.sh 2
ci/mpitest.sh 3
ci/mpitest.sh 4
ci/mpitest.sh 4 2 -k "hierarchical or auto or topology or agreement or join or grouped_gives_each_vector or test_quantized or test_topk"
ci/mpitest.sh 3 2 -k "hierarchical or auto or topology or agreement or join or grouped_gives_each_vector or test_quantized or test_topk"
ci/paths.sh
echo "== all suites passed in $(( $(date +%s) - start ))s"
