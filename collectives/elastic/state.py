"""What an elastic job keeps across a failure (Horovod's State and ObjectState).

A State is committed in memory by every rank (`commit`, cheap enough to call every step),
restored by every survivor after a failure (`restore`), made alike from rank 0 (`sync`, at
the start of `run` and after every shrink), and told when the job shrank (`on_reset`, which
runs the user's reset callbacks). Under `run` with a snapshot folder, a commit is also
written to disk by a background thread (elastic/snapshot.py), and under the launcher a
commit is where the job stops for a restart on new hosts (elastic/membership.py)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

from collectives import api as C
from collectives.api.gather import broadcast_object
from collectives.elastic import membership
from collectives.elastic.membership import HostsUpdatedInterrupt, Membership
from collectives.elastic.snapshot import Writer, first_on_host
from collectives.runtime import topology


class State:
    """The base of elastic states: subclasses say how to save, restore and sync what they
    hold. bcast_object(obj, root_rank) (Horovod's argument) defaults to collectives'
    broadcast_object; get_rank, Horovod's other argument, is accepted for its signature
    (sync always takes rank 0's state)."""

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None):
        self._bcast_object = broadcast_object if bcast_object is None else bcast_object
        self._reset_callbacks: list[Callable[[], None]] = []
        #: Commits the job made, across its restarts (the number of the last one).
        self.commits = 0
        self._membership: Membership | None = None  # under the launcher (set by run)
        self._writer: Writer | None = None  # where snapshots go (set by run)
        self._interval_s = 0.0  # seconds between snapshots; 0: every commit
        self._snapshot_at = 0.0  # time.monotonic() of the last snapshot

    def attach(self, membership: Membership | None, writer: Writer | None,
               interval_s: float) -> None:
        """Under run: the launcher's folder and the snapshot writer, if any."""
        self._membership, self._writer, self._interval_s = membership, writer, interval_s

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of callbacks() after the job shrank, before the state is synced (to
        rescale the learning rate by the new size, re-partition data, ...)."""
        if not all(callable(cb) for cb in callbacks):
            raise TypeError("callbacks: expected a list of callables")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """The job shrank: reset what depends on its size, then run the reset callbacks."""
        self.reset()
        self.run_callbacks()

    def run_callbacks(self) -> None:
        """The reset callbacks alone (a job resumed from a snapshot, laid out at its size)."""
        for cb in self._reset_callbacks:
            cb()

    def commit(self) -> None:
        """Keep the current state in memory: a failure from here on restores it. Under run
        with snapshots, the commit is also written to disk, on a thread; where the launcher
        restarts the job on new hosts, raises HostsUpdatedInterrupt (on every rank) once the
        commit is on disk everywhere."""
        self.flush_snapshots()  # raises a failed write's error here
        self.save()
        self.commits += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod's check for new hosts: snapshot the commit if one is due, and raise
        HostsUpdatedInterrupt on every rank if the launcher wants the job stopped here
        (collective under the launcher or with snapshots on a timer)."""
        if self._writer is None and self._membership is None:
            return
        due = self._writer is not None and \
            time.monotonic() - self._snapshot_at >= self._interval_s
        snap, stop = membership.plan(self._membership, due,
                                     decided=self._writer is None or self._interval_s == 0)
        if self._membership is not None:
            self._membership.report(self.commits)
        if stop and self._writer is None:
            raise RuntimeError("collectives.elastic: the launcher asked for a stop, but the "
                               "job writes no snapshots (Config.snapshot_dir)")
        if snap or stop:
            self._snapshot_at = time.monotonic()
            self.write_snapshot(block=stop)
        if stop:
            C.barrier()  # every rank's snapshot is on disk
            self._membership.report(self.commits, "stopped")
            raise HostsUpdatedInterrupt()

    def flush_snapshots(self) -> None:
        """Wait until the last snapshot handed to the writer is on disk (run does when the
        function returns; a job that must not exit before it does, too)."""
        if self._writer is not None:
            self._writer.wait()

    def write_snapshot(self, block: bool = False) -> None:
        """Hand this rank's part of the last commit to the snapshot writer (the replicated
        part on the first rank of each host only)."""
        topo = topology.get()
        shard, held = self.shard_snapshot()
        self._writer.write(self.commits, topo.rank, topo.size,
                           self.replicated_snapshot() if first_on_host(topo) else None,
                           shard, held, block)

    def replicated_snapshot(self) -> Any:
        """What every rank holds alike at the last commit, as it is written to disk."""
        raise NotImplementedError

    def shard_snapshot(self) -> tuple[Any, int | None]:
        """This rank's own part of the last commit and the rank whose part's copy it
        keeps; (None, None) where every rank holds the same."""
        return None, None

    @property
    def sharded(self) -> bool:
        """Whether each rank holds a part of the state of its own (shard_snapshot)."""
        return False

    def load_replicated(self, replicated: Any) -> None:
        """Make replicated (replicated_snapshot's) the last commit, and restore it."""
        raise NotImplementedError

    def load_shards(self, old_size: int, parts: dict[int, Any]) -> None:
        """Collective: lay out the sharded state from the parts of the old_size ranks that
        wrote it (each passed by one rank)."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """What depends on the job's size (nothing, here)."""


class ObjectState(State):
    """Picklable values kept as attributes (`ObjectState(epoch=0, batch=0)`; state.epoch):
    commit deep-copies them, restore puts the copies back, sync gives every rank rank 0's
    committed values."""

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any):
        super().__init__(bcast_object, get_rank)
        self._keys = list(kwargs)
        for k, v in kwargs.items():
            setattr(self, k, v)
        self._saved = copy.deepcopy(kwargs)

    def save(self) -> None:
        self._saved = {k: copy.deepcopy(getattr(self, k)) for k in self._keys}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._keys:
            self._saved = self._bcast_object(self._saved, 0)
            self._set_attrs()

    def replicated_snapshot(self) -> Any:
        return {"values": self._saved}

    def load_replicated(self, replicated: Any) -> None:
        self._saved = replicated["values"]
        self._set_attrs()

    def _set_attrs(self) -> None:
        for k, v in copy.deepcopy(self._saved).items():
            setattr(self, k, v)
