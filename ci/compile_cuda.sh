#!/usr/bin/env bash
# Compile every CUDA kernel (csrc/cuda/*.cu) with nvcc so they never rot on machines
# without a GPU. At run time CuPy compiles the same files (collectives/kernels/cuda.py).
#   bash ci/compile_cuda.sh          # exits 0 and says so when nvcc is absent
# Set NVCC_ARCH (default sm_80) to target another architecture.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$nvcc" ]]; then
  echo "compile_cuda: nvcc not found; skipping the CUDA compile check"
  exit 0
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
for src in "$root"/csrc/cuda/*.cu; do
  name="$(basename "$src" .cu)"
  # -Werror=all-warnings: a warning today is a bug on some GPU tomorrow. -ftz=true: CuPy
  # compiles with it, and no instruction may flush subnormals (csrc/cuda/ieee.cuh).
  if ! "$nvcc" -std=c++17 -arch="${NVCC_ARCH:-sm_80}" -ftz=true -I"$root/csrc/cuda" \
      -Werror all-warnings --ptx "$src" -o "$out/$name.ptx"; then
    echo "compile_cuda: FAILED $name.cu"
    status=1
  elif grep -q '\.ftz' "$out/$name.ptx"; then
    grep -n '\.ftz' "$out/$name.ptx" | head -n 5 || true
    echo "compile_cuda: FAILED $name.cu: the instructions above flush subnormals under -ftz=true"
    status=1
  else
    echo "compile_cuda: ok     $name.cu"
  fi
done
exit "$status"
