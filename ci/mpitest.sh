#!/usr/bin/env bash
# Run the MPI test suite once under mpirun: ci/mpitest.sh NP [RANKS_PER_NODE] [pytest args...]
# Rank 0's output is shown; every rank's log is kept under build/mpitest/. An outer timeout
# turns a hang into a failure with a message; an error on one rank aborts all (mpi4py -m).
set -u
np=$1; rpn=${2:-}; shift $(( $# >= 2 ? 2 : 1 ))
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
mpirun=${MPIRUN:-$(dirname "$py")/mpirun}
limit=${MPITEST_TIMEOUT_S:-900}
logs=$here/build/mpitest/np$np${rpn:+-rpn$rpn}
rm -rf "$logs" && mkdir -p "$logs"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_osc=${OMPI_MCA_osc:-^ucx}  # see Makefile
export OMPI_MCA_btl=${OMPI_MCA_btl:-^ofi}  # see Makefile
env_args=()
[ -n "$rpn" ] && env_args=(-x COLLECTIVES_RANKS_PER_NODE="$rpn")
echo "== tests/mpi at np=$np${rpn:+ (simulated nodes of $rpn ranks)} =="
start=$(date +%s)
timeout --kill-after=10 "$limit" "$mpirun" -np "$np" --oversubscribe "${env_args[@]}" \
  bash -c 'exec "$0" -m mpi4py -m pytest -x -q --with-mpi -p no:cacheprovider --color=no --durations=8 tests/mpi "$@" \
           > "'"$logs"'/rank$OMPI_COMM_WORLD_RANK.log" 2>&1' "$py" "$@"
rc=$?
grep -a -v -E "^(rank|size|MPI |mpi4py)" "$logs/rank0.log"
if [ $rc -ne 0 ]; then
  [ $rc -eq 124 ] && echo "!! np=$np timed out after ${limit}s: a collective hung (see $logs)"
  for f in "$logs"/rank*.log; do echo "---- $f (tail)"; tail -n 30 "$f"; done
  echo "!! np=$np${rpn:+ rpn=$rpn} FAILED (exit $rc)"
  exit 1
fi
echo "== np=$np${rpn:+ rpn=$rpn} passed in $(( $(date +%s) - start ))s"
