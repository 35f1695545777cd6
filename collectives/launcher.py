"""collectives-run: the launcher of elastic jobs, which owns their membership (Horovod's
elastic horovodrun, with its options where they mean the same).

    collectives-run -np 2 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh \\
        python train.py

It starts `mpirun --with-ft ulfm` on the hosts listed (-H, --hostfile, a discovery script,
else a Slurm allocation, else this machine), with the job's run folder and snapshot folder
in its environment, and watches three things:
- **A failed rank**: the job shrinks in place (collectives.elastic.run, no restart); its
  rank 0 reports the new size, and if the hosts have free slots, the launcher grows it back
  as below.
- **More slots listed** (up to --max-np), or fewer ranks than slots after a failure, or a
  host the job runs on gone from the listing: the launcher asks the job to stop at its next
  commit (elastic/membership.py); every rank snapshots that commit and exits, and the
  launcher starts the job again on the new host list, where `run` resumes from the snapshot
  (elastic/snapshot.py) and calls the reset callbacks. No step is lost.
- **A lost host** (its daemon gone: Open MPI ends the whole job, with status 0): the job
  neither finished nor stopped, so the launcher leaves the host out (Horovod's blacklist:
  for good, or with --blacklist-cooldown-range MIN MAX for MIN seconds after its first
  loss, twice as long after each next one, at most MAX) and starts the job again on the
  hosts left, from the last snapshot every host left holds.
Whether the job finished is read from its rank 0's status, never from mpirun's exit status.
A command that never reaches collectives.elastic.run (its rank 0 writes no status) is not
elastic: it runs once, and the launcher exits with its status. One line per change goes to
standard error (hosts, size, why, the time it took)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from collectives import config as _config
from collectives.elastic import hosts as _hosts
from collectives.elastic.discovery import Discovery
from collectives.elastic.snapshot import check_writable

#: Seconds between two looks at the hosts and the job's status.
POLL_S = 0.25
#: Failed starts in a row (the job ended with no progress and no host lost) that end the run.
FAILED_STARTS = 3


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="collectives-run", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-np", "--num-proc", dest="np", type=int, default=None,
                    help="ranks to start with (default: every slot listed, up to --max-np)")
    ap.add_argument("--min-np", type=int, default=None,
                    help="fewest ranks to start a job with (default: -np, else 1)")
    ap.add_argument("--max-np", type=int, default=None,
                    help="most ranks the job grows to (default: every slot listed)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", default=None, help="host0:2,host1:2")
    where.add_argument("--hostfile", default=None,
                       help="`host slots=N` or `host:N` lines")
    where.add_argument("--host-discovery-script", default=None,
                       help="a script (or file) listing `host:slots` lines, read every "
                            "second: the job grows and shrinks with it")
    ap.add_argument("--mpi-args", default="",
                    help='more mpirun arguments, as one string: --mpi-args="--bind-to none"')
    ap.add_argument("--snapshot-dir", default=None,
                    help="each host's snapshots go under this folder, in a folder named "
                         "by the host (default: a new folder under the temporary folder)")
    ap.add_argument("--snapshot-interval", type=float, default=0.0,
                    help="seconds between two snapshots (default 0: every commit)")
    ap.add_argument("--run-dir", default=None,
                    help="the folder the launcher and the job's rank 0 talk through; on "
                         "several hosts, one that rank 0's host sees too (default: a new "
                         "folder under the temporary folder)")
    ap.add_argument("--start-timeout", type=float, default=60.0,
                    help="seconds to wait for --min-np slots before giving up (default 60)")
    ap.add_argument("--blacklist-cooldown-range", type=float, nargs=2, default=None,
                    metavar=("MIN", "MAX"),
                    help="a host left out after a loss comes back after MIN seconds, "
                         "twice as long after each further loss, at most MAX (default: "
                         "never)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the training command")
    args = ap.parse_args(argv)
    if not args.command:
        ap.error("the training command is missing (e.g. python train.py)")
    for name in ("np", "min_np", "max_np"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {value}")
    if args.min_np is None:
        args.min_np = args.np or 1
    if args.max_np is not None and args.max_np < args.min_np:
        ap.error(f"--max-np: expected at least --min-np={args.min_np}, got {args.max_np}")
    if args.blacklist_cooldown_range is not None:
        low, high = args.blacklist_cooldown_range
        if not 0 <= low <= high:
            ap.error(f"--blacklist-cooldown-range: expected 0 <= MIN <= MAX, got {low:g} "
                     f"{high:g}")
    return args


class Hosts:
    """The hosts the job may run on now: the listing, less the hosts left out."""

    def __init__(self, args: argparse.Namespace):
        self.discovery = None
        self.fixed: dict[str, int] | None = None
        if args.host_discovery_script:
            self.discovery = Discovery(args.host_discovery_script)
        elif args.hosts:
            self.fixed = _hosts.from_list(args.hosts)
        elif args.hostfile:
            self.fixed = _hosts.from_hostfile(args.hostfile)
        else:
            self.fixed = _hosts.from_slurm(dict(os.environ)) or \
                {"localhost": args.np or args.min_np}
        self.left_out: dict[str, float] = {}  # host -> when it may come back (inf: never)
        self.losses: dict[str, int] = {}  # host -> times it was lost in this run
        self.cooldown = args.blacklist_cooldown_range

    def listed(self) -> dict[str, int] | None:
        return self.fixed if self.discovery is None else self.discovery.hosts()

    def usable(self) -> dict[str, int]:
        now = time.monotonic()
        self.left_out = {h: t for h, t in self.left_out.items() if t > now}
        return {h: s for h, s in (self.listed() or {}).items() if h not in self.left_out}

    def leave_out(self, host: str) -> float:
        """Leave host out after its loss; the seconds until it may come back (inf: never)."""
        self.losses[host] = self.losses.get(host, 0) + 1
        delay = float("inf")
        if self.cooldown is not None:
            low, high = self.cooldown
            delay = min(high, low * 2.0 ** (self.losses[host] - 1))
        self.left_out[host] = time.monotonic() + delay
        return delay


def say(start: float, text: str) -> None:
    print(f"collectives-run [{time.monotonic() - start:7.1f} s] {text}", file=sys.stderr,
          flush=True)


class Job:
    """One mpirun of the training command (epoch: its number in this run)."""

    def __init__(self, args: argparse.Namespace, epoch: int, hosts: dict[str, int], np_: int,
                 run_dir: str, snapshot_dir: str):
        self.epoch, self.hosts, self.np = epoch, hosts, np_
        self.lost_hosts: list[str] = []
        with open(os.path.join(run_dir, "epoch"), "w") as f:
            f.write(str(epoch))
        for name in ("stop", "status.json"):
            try:
                os.remove(os.path.join(run_dir, name))
            except FileNotFoundError:
                pass
        env = dict(os.environ, COLLECTIVES_RUN_DIR=run_dir,
                   COLLECTIVES_SNAPSHOT_DIR=snapshot_dir,
                   COLLECTIVES_SNAPSHOT_INTERVAL_S=str(args.snapshot_interval))
        if epoch > 1:  # as after a shrink: `auto` on the cache or its model, no measuring
            env.setdefault("COLLECTIVES_AUTOTUNE", "0")
        mpirun = shlex.split(_config.from_env().mpirun or "mpirun")
        given = [a for v in ("COLLECTIVES_RUN_DIR", "COLLECTIVES_SNAPSHOT_DIR",
                             "COLLECTIVES_SNAPSHOT_INTERVAL_S", "COLLECTIVES_AUTOTUNE")
                 if v in env for a in ("-x", v)]
        cmd = [*mpirun, "--with-ft", "ulfm", "-np", str(np_),
               "--host", _hosts.mpirun_hosts(hosts, np_), *given,
               *shlex.split(args.mpi_args), *args.command]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._readers = [threading.Thread(target=self._read, args=(src, dst), daemon=True)
                         for src, dst in ((self.proc.stdout, sys.stdout),
                                          (self.proc.stderr, sys.stderr))]
        for reader in self._readers:
            reader.start()

    def _read(self, source, sink) -> None:
        """Pass one of mpirun's outputs on, noting the hosts whose daemon it lost."""
        for line in source:
            sink.write(line)
            sink.flush()
            # PRTE's notices of a lost daemon: "Remote daemon: [...] on node H" (lost
            # communication) or "Remote host:   H" (a daemon that failed to report back)
            m = re.search(r"Remote (?:daemon:.* on node|host:)\s+(\S+)", line)
            if m and m.group(1) not in self.lost_hosts:
                self.lost_hosts.append(m.group(1))

    def wait(self) -> int:
        rc = self.proc.wait()
        for reader in self._readers:
            reader.join()
        return rc

    def stop(self) -> None:
        """End the job at once (the launcher itself was interrupted)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def wall_offset() -> float:
    """time.time() - time.monotonic(): turns the job's wall-clock times into this clock's."""
    return time.time() - time.monotonic()


def status(run_dir: str, epoch: int) -> dict | None:
    """The job's status as its rank 0 last wrote it, if of this epoch."""
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            found = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return found if found.get("epoch") == epoch else None


def size_for(args: argparse.Namespace, usable: dict[str, int], first: bool) -> int:
    """Ranks to start on usable hosts: every slot up to --max-np (-np for the first job)."""
    n = sum(usable.values())
    if args.max_np is not None:
        n = min(n, args.max_np)
    if first and args.np is not None:
        n = min(n, args.np)
    return n


def wait_for_slots(args: argparse.Namespace, hosts: Hosts, start: float) -> dict[str, int]:
    """The usable hosts once they have --min-np slots; SystemExit after --start-timeout."""
    deadline = time.monotonic() + args.start_timeout
    said = False
    while True:
        usable = hosts.usable()
        if sum(usable.values()) >= args.min_np:
            return usable
        if time.monotonic() > deadline:
            raise SystemExit(
                f"collectives-run: {sum(usable.values())} slots listed on usable hosts "
                f"{usable}, fewer than --min-np={args.min_np}, after waiting "
                f"{args.start_timeout:g} s (--start-timeout); left out: "
                f"{sorted(hosts.left_out)}")
        if not said and time.monotonic() > deadline - args.start_timeout + 2:
            say(start, f"waiting for {args.min_np} slots (usable now: {usable})")
            said = True
        time.sleep(POLL_S)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.monotonic()
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="collectives-run-")
    os.makedirs(run_dir, exist_ok=True)
    snapshot_dir = args.snapshot_dir or tempfile.mkdtemp(prefix="collectives-snapshots-")
    check_writable(snapshot_dir)
    hosts = Hosts(args)
    say(start, f"snapshots under {snapshot_dir} (a folder per host); run folder {run_dir}")
    epoch, failed_starts, why, since = 0, 0, "start", start
    last_commits = -1
    while True:
        usable = wait_for_slots(args, hosts, start)
        epoch += 1
        np_ = size_for(args, usable, epoch == 1)
        job = Job(args, epoch, usable, np_, run_dir, snapshot_dir)
        say(start, f"job {epoch}: {np_} ranks on {_hosts.mpirun_hosts(usable, np_)} ({why})")
        try:
            why, since = watch(job, args, hosts, run_dir, start, why, since)
        except KeyboardInterrupt:
            job.stop()
            job.wait()
            raise
        rc = job.wait()
        end = status(run_dir, epoch)
        state = None if end is None else end["state"]
        if state == "done":
            say(start, f"job {epoch} finished at {end['size']} ranks, "
                       f"{end['commits']} commits")
            for made, given in ((run_dir, args.run_dir), (snapshot_dir, args.snapshot_dir)):
                if given is None:  # the launcher's own folders go with the finished job
                    shutil.rmtree(made, ignore_errors=True)
            return 0
        if state == "stopped":
            failed_starts = 0
            continue
        commits = -1 if end is None else end["commits"]
        if job.lost_hosts:
            for host in job.lost_hosts:
                delay = hosts.leave_out(host)
                say(start, f"host {host} left out " + ("for good" if delay == float("inf")
                                                        else f"for {delay:g} s"))
            why, since = f"lost host {','.join(job.lost_hosts)}", time.monotonic()
            failed_starts = 0
        elif end is None:
            say(start, f"job {epoch} ended with status {rc} without reaching "
                       f"collectives.elastic.run (no status from its rank 0): not an elastic "
                       f"job, so it is not started again")
            return rc
        else:
            failed_starts = failed_starts + 1 if commits <= last_commits else 1
            why, since = f"job {epoch} ended with status {rc}", time.monotonic()
            if failed_starts >= FAILED_STARTS:
                say(start, f"job {epoch} ended with status {rc} before any new commit, "
                           f"{failed_starts} times in a row; giving up")
                return rc or 1
        last_commits = max(last_commits, commits)
        say(start, f"job {epoch} ended without finishing ({why}); starting again from the "
                   f"last snapshot")


def watch(job: Job, args: argparse.Namespace, hosts: Hosts, run_dir: str, start: float,
          why: str, since: float) -> tuple[str, float]:
    """Until the job's mpirun ends: say when it trains at a new size, and ask it to stop at
    its next commit once the hosts call for another size (wanted_change). Returns why the
    next job starts, if one does, and since when (this clock)."""
    shown, asked = None, False
    while job.proc.poll() is None:
        time.sleep(POLL_S)
        now = status(run_dir, job.epoch)
        if now is not None and now["state"] == "running" and \
                (now["size"], now["hosts"]) != shown:
            shown = (now["size"], now["hosts"])
            took = now["time"] - wall_offset() - since
            say(start, f"job {job.epoch} trains at {now['size']} ranks on "
                       f"{','.join(now['hosts'])}, {took:.1f} s after {why}")
        if asked or now is None:
            continue
        change = wanted_change(args, hosts.usable(), now)
        if change:
            with open(os.path.join(run_dir, "stop.tmp"), "w") as f:
                f.write(str(job.epoch))
            os.replace(os.path.join(run_dir, "stop.tmp"), os.path.join(run_dir, "stop"))
            asked = True
            if now["size"] < job.np:  # timed from the failure, as rank 0 reported it
                why, since = f"ranks failed; {change}", now["time"] - wall_offset()
            else:
                why, since = change, time.monotonic()
            say(start, f"job {job.epoch}: stopping at its next commit ({why})")
    return why, since


def wanted_change(args: argparse.Namespace, usable: dict[str, int], now: dict) -> str:
    """Why the running job should stop for a restart, or "" (it should not)."""
    names = {_hosts.canonical(h) for h in usable}
    gone = [h for h in now["hosts"] if h not in names]
    if gone and sum(usable.values()) >= args.min_np:
        return f"host {','.join(gone)} no longer listed"
    target = size_for(args, usable, first=False)
    if target > now["size"]:
        return f"{target} slots for {now['size']} ranks"
    return ""


if __name__ == "__main__":
    sys.exit(main())
