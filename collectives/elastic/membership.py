"""The job's side of the launcher (`collectives-run`, collectives/launcher.py), which owns the
job's membership: it starts the job, watches the hosts, and restarts the job on a new host
list when it should grow or lose a host; failed ranks are shrunk in place by the job.

The two talk through files in the launcher's run folder (Config.run_dir, which the
launcher sets; it must be on a filesystem rank 0's host shares with the launcher's):
- `epoch`: the number of the job the launcher started last (written before it starts it);
- `stop`: an epoch the launcher wants stopped at its next commit (the job then snapshots
  that commit on every rank, rank 0 says so in its status, and every rank exits: the next
  job resumes from that commit);
- `status.json`: written by the job's rank 0 (atomically): its epoch, size, hosts and
  commit count, and `state`: "started" (as collectives.elastic.run begins: the job is
  elastic), "running" (written at the first commit at each size), "stopped" (at a commit,
  for a restart) or "done" (the training function returned).

Cost at a commit under the launcher: a stat of the `stop` file on rank 0 and one small
broadcast (rank 0's answer, which also says whether the commit is snapshotted)."""

from __future__ import annotations

import json
import os
import socket
import time

from collectives.api.gather import broadcast_object
from collectives.runtime import topology


class HostsUpdatedInterrupt(RuntimeError):
    """Raised on every rank by a commit at which the launcher changes the job's hosts
    (Horovod's name), after the commit was snapshotted: collectives.elastic.run ends the
    process, and the launcher starts the job again on the new hosts, from that commit.
    skip_sync: Horovod's field; a restarted job always syncs."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the launcher restarts the job on new hosts at this commit")
        self.skip_sync = skip_sync


class Membership:
    """One process's view of the launcher's run folder (rank 0 reads and writes it)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self._epoch: int | None = None  # read by the first rank 0 that needs it
        self._reported: tuple[int, int] | None = None  # (generation, size) said last

    @property
    def epoch(self) -> int:
        """The number the launcher gave this job (read from the run folder)."""
        if self._epoch is None:
            try:
                with open(os.path.join(self.run_dir, "epoch")) as f:
                    self._epoch = int(f.read())
            except FileNotFoundError as exc:
                raise RuntimeError(
                    f"run_dir: the launcher's run folder {self.run_dir!r} is not on this host "
                    f"({socket.gethostname()}); give collectives-run a --run-dir that every "
                    f"host of the job sees (a shared filesystem)") from exc
        return self._epoch

    def stop_wanted(self) -> bool:
        """Rank 0: whether the launcher wants this job stopped at this commit."""
        try:
            with open(os.path.join(self.run_dir, "stop")) as f:
                return int(f.read() or -1) == self.epoch
        except FileNotFoundError:
            return False

    def report(self, commits: int, state: str = "running") -> None:
        """Rank 0: write the job's status (for "running", only when its size changed)."""
        topo = topology.get()
        if topo.rank != 0:
            return
        if state == "running":
            if self._reported == (topo.generation, topo.size):
                return
            self._reported = (topo.generation, topo.size)
        hosts = sorted({host for host, _ in topo.processes})
        status = {"epoch": self.epoch, "size": topo.size, "hosts": hosts,
                  "commits": commits, "state": state, "time": time.time()}
        path = os.path.join(self.run_dir, "status.json")
        with open(path + ".tmp", "w") as f:
            json.dump(status, f)
        os.replace(path + ".tmp", path)


def plan(membership: Membership | None, snapshot: bool, decided: bool) -> tuple[bool, bool]:
    """At a commit, alike on every rank: (snapshot it, stop the job at it). snapshot is rank
    0's answer; decided, whether every rank has the same one already (snapshots at every
    commit, or none): then a job that is not launched decides without a message."""
    if membership is None and decided:
        return snapshot, False
    answer = (snapshot, membership is not None and membership.stop_wanted()) \
        if topology.rank() == 0 else None
    return broadcast_object(answer, 0)
