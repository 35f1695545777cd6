"""Elastic training under the launcher: how long each change of membership takes, and what
a lost host costs.

    python benchmarks/elastic_launch.py                # one host: 3 ranks, a 4th slot listed
    python benchmarks/elastic_launch.py --rig          # three emulated hosts (needs root)

Runs collectives-run on tests/scripts/launched.py (a small model, a commit and a snapshot at
every step, --step-s seconds a step). On one host: started at 3 ranks with 3 slots listed;
at step 8 a 4th is listed (the job grows), the last rank dies after 3 steps at 4 (the job
shrinks in place and grows back). With --rig ($NETRIG names its folder; three hosts, one
slot each, 1 Gbit/s): started on host0 and host1; host2 listed at step 8; the rank on host2
dies after 3 steps at 3; at step 45 host1 is killed whole (`netrig.sh kill-host`) and
unlisted. From rank 0's log of every step's start (time, step, size) it prints, for each
change, the seconds from the event (the listing written, the kill) to the first step at the
new size, and the steps that ran twice (begun before the event, run again after it)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rig", action="store_true", help="three emulated hosts")
    ap.add_argument("--api", choices=["train", "adam", "zero"], default="train",
                    help="DistributedOptimizer over SGD on a linear model (train) or "
                         "over Adam on a 32-64-64-1 network (adam), or ZeroOptimizer "
                         "stage 2 (zero)")
    ap.add_argument("--steps", type=int, default=70)
    ap.add_argument("--step-s", type=float, default=0.1)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="elastic-launch-"))
    events = tmp / "events"
    events.mkdir()
    listing = tmp / "hosts.txt"
    rig = Path(os.environ.get("NETRIG", ROOT.parent / "shared" / "netrig")) / "netrig.sh"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PATH=f"{BIN}:{os.environ['PATH']}", EVENTS=str(events), DISCOVERY=str(listing),
               STEPS=str(args.steps), STEP_S=str(args.step_s))
    if args.rig:
        subprocess.run([str(rig), "up", "3", "1gbit", "0"], env=env, check=True,
                       capture_output=True)
        listing.write_text("host0:1\nhost1:1\n")
        env.update(COLLECTIVES_MPIRUN=f"{rig} mpirun", GROW_AT="8:host0:1;host1:1;host2:1",
                   KILL_AT="3:3", KILL_HOST_AT="45:host1")
        start = ["-np", "2", "--min-np", "2"]
    else:
        listing.write_text("localhost:3\n")
        env.update(GROW_AT="8:localhost:4", KILL_AT="3:4")
        start = ["-np", "3", "--mpi-args=--oversubscribe"]
    cmd = [str(BIN / "collectives-run"), *start, "--host-discovery-script", str(listing),
           "--snapshot-dir", str(tmp / "snaps"), sys.executable,
           str(ROOT / "tests" / "scripts" / "launched.py"), args.api]
    host_killed = None
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        while proc.poll() is None:
            if args.rig and host_killed is None and (events / "kill-host").exists():
                listing.write_text("host0:1\nhost2:1\n")
                host_killed = time.time()
                subprocess.run([str(rig), "kill-host", "host1"], env=env, capture_output=True)
            time.sleep(0.05)
        out = proc.communicate()[0]
    finally:
        if args.rig:
            subprocess.run([str(rig), "down"], env=env, capture_output=True)
    if proc.returncode != 0:
        sys.exit(f"the launcher ended with status {proc.returncode}:\n{out}")
    log = [line.split() for line in (events / "steps").read_text().splitlines()]
    log = [(float(t), int(job), int(step), int(n)) for t, job, step, n in log]
    full = 3 if args.rig else 4
    print(f"{'rig, 3 hosts' if args.rig else 'one host'}, {args.api}, a step of "
          f"{args.step_s:g} s, {args.steps} steps, snapshots every step")
    report("a slot listed", (events / "grow").stat().st_mtime, log, full)
    report("a rank killed", (events / "kill").stat().st_mtime, log, full)
    if host_killed is not None:
        report("a host killed", host_killed, log, full - 1)
    print("\n".join(line.strip() for line in out.splitlines() if "collectives-run [" in line))


def report(what: str, at: float, log: list[tuple[float, int, int, int]], size: int) -> None:
    """Seconds from at to the first step at size of a job started after at (the kill of a
    rank: of the job that grew back), and the steps begun before that step and run again
    from it."""
    was = next(job for t, job, _, _ in reversed(log) if t < at)
    first = next(((t, job, step) for t, job, step, n in log
                  if t > at and job > was and n == size), None)
    if first is None:
        print(f"{what}: no job at {size} ranks after it")
        return
    t, job, step = first
    begun = max(s for u, _, s, _ in log if u < t)
    print(f"{what}: first step of job {job}, at {size} ranks, {t - at:.1f} s later; steps "
          f"run again: {begun + 1 - step}")


if __name__ == "__main__":
    main()
