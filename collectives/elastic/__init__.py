"""Elastic training: when ranks die, the survivors shrink the job and train on from the last
commit, in memory, without a restart.

    state = collectives.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)

    @collectives.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                ...one step...
                state.commit()
            state.batch = 0

    train(state)

It needs the fault-tolerant mode (collectives/runtime/faults.py: run the job under
`mpirun --with-ft ulfm`), in which a dead rank raises RanksFailedError on every survivor.
`run` then restores the state's last commit, shrinks the job to the survivors
(runtime/topology.shrink: new communicators, nodes, windows, `auto` for the new size),
calls the state's reset callbacks (where the user rescales the learning rate or
re-partitions data), syncs the state from the new rank 0 and calls the function again.
Outside that mode, `run` calls the function once and a failure ends the job as before.
Horovod's names (hvd.elastic.run, State, ObjectState, TorchState, ElasticSampler) are these.

May import: the leaves, kernels, runtime, algorithms, auto, compression, api, optim."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from collectives.api.gather import broadcast_object
from collectives.elastic import snapshot
from collectives.elastic.membership import HostsUpdatedInterrupt, Membership
from collectives.elastic.snapshot import Writer
from collectives.elastic.state import ObjectState, State
from collectives.runtime import faults, topology
from collectives.runtime.faults import RanksFailedError

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "RanksFailedError",
           "State", "TorchState", "run"]


def run(func: Callable[..., Any] | None = None, *, min_size: int = 1) -> Any:
    """Decorate func(state, *args, **kwargs) so that a failure of ranks restores `state`'s
    last commit, shrinks the job to the survivors and calls func again (on every survivor;
    Horovod's hvd.elastic.run). func starts after state is synced from rank 0. With fewer
    than min_size survivors the job ends instead (SystemExit naming the dead ranks, on every
    survivor): `@run(min_size=4)`.

    With a snapshot folder (Config.snapshot_dir: COLLECTIVES_SNAPSHOT_DIR, which the
    launcher sets), commits are also written to disk on a thread (elastic/snapshot.py), and
    the job starts from the newest snapshot its hosts hold, at whatever size it now has
    (then the reset callbacks run). Under the launcher (`collectives-run`,
    collectives/launcher.py), a commit at which the launcher changes the job's hosts ends every
    process once the commit is on disk (SystemExit(0)); the launcher starts the job again
    on the new hosts, from that commit."""
    if func is None:
        return functools.partial(run, min_size=min_size)
    if not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size: expected an int >= 1, got {min_size!r}")

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"state: expected a collectives.elastic State, got "
                            f"{type(state).__name__}")
        config = topology.get().config
        members = None if config.run_dir is None else Membership(config.run_dir)
        writer = None if config.snapshot_dir is None else Writer(config.snapshot_dir)
        if members is not None and writer is None:
            raise ValueError("snapshot_dir: the launcher sets COLLECTIVES_RUN_DIR and "
                             "COLLECTIVES_SNAPSHOT_DIR together; got no snapshot folder")
        state.attach(members, writer, config.snapshot_interval_s)
        if members is not None:  # the launcher restarts only a job that says it is elastic
            members.report(state.commits, "started")
        resumed = None if writer is None else snapshot.resume(state, config.snapshot_dir)
        if resumed is not None:
            state.commits = resumed
        while True:
            try:
                state.sync()
                state.commits = broadcast_object(state.commits, 0)
                if resumed is not None:  # laid out at this size already: the callbacks only
                    state.run_callbacks()
                    resumed = None
                result = func(state, *args, **kwargs)
                state.flush_snapshots()
                if members is not None:
                    members.report(state.commits, "done")
                return result
            except HostsUpdatedInterrupt:
                raise SystemExit(0) from None  # the launcher starts the job on new hosts
            except Exception as exc:
                if not _failed(exc):
                    raise
                lost = faults.failed(topology.get())
                state.restore()
                topology.shrink()
                if topology.size() < min_size:
                    raise SystemExit(
                        f"collectives.elastic: ranks {lost} failed and {topology.size()} are "
                        f"left, fewer than min_size={min_size}; ending the job") from exc
                state.on_reset()

    return wrapper


def _failed(exc: Exception) -> bool:
    """Whether exc comes from ranks that failed: RanksFailedError, or an error that wraps
    it (torch's futures, as DDP waits on them, turn it into a RuntimeError) raised while
    the job's communicator has lost ranks."""
    return isinstance(exc, RanksFailedError) or faults.failed(topology.get()) is not None


def __getattr__(name: str) -> Any:
    """TorchState and ElasticSampler, imported with torch on first use."""
    if name in ("TorchState", "ElasticSampler"):
        from collectives.elastic import torch_state
        return getattr(torch_state, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
