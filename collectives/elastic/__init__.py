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
import os
from collections.abc import Callable
from typing import Any

from collectives.elastic import membership
from collectives.elastic.membership import HostsUpdatedInterrupt
from collectives.elastic.state import ObjectState, State
from collectives.runtime import faults, topology
from collectives.runtime.faults import RanksFailedError

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "RanksFailedError",
           "State", "TorchState", "run"]


def run(func: Callable[..., Any] | None = None, *, min_size: int = 1,
        max_size: int | None = None, discovery: str | None = None) -> Any:
    """Decorate func(state, *args, **kwargs) so that a failure of ranks restores `state`'s
    last commit, shrinks the job to the survivors and calls func again (on every survivor;
    Horovod's hvd.elastic.run). func starts after state is synced from rank 0. With fewer
    than min_size survivors the job ends instead (SystemExit naming the dead ranks, on every
    survivor): `@run(min_size=4)`.

    With max_size (or Config.elastic_max_size) the job grows back to that many ranks: after
    a shrink rank 0 starts replacements, which join at a later commit
    (elastic/membership.py); without, it only shrinks. With discovery (or
    Config.elastic_discovery), the path of a file or script listing `host:slots` lines
    (Horovod's host-discovery script, elastic/discovery.py), the job also grows into the
    slots listed, up to max_size if set. In a new process, run first waits for the job to
    take it in, then syncs state from rank 0 and calls the reset callbacks like every
    rank."""
    if func is None:
        return functools.partial(run, min_size=min_size, max_size=max_size,
                                 discovery=discovery)
    if not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size: expected an int >= 1, got {min_size!r}")
    if max_size is not None and (not isinstance(max_size, int) or max_size < min_size):
        raise ValueError(f"max_size: expected None or an int >= min_size={min_size}, "
                         f"got {max_size!r}")
    if discovery is not None and not isinstance(discovery, (str, os.PathLike)):
        raise TypeError(f"discovery: expected the path of a file or script listing "
                        f"host:slots lines, got {type(discovery).__name__}")

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"state: expected a collectives.elastic State, got "
                            f"{type(state).__name__}")
        membership.set_target(max_size, None if discovery is None else os.fspath(discovery))
        if membership.is_replacement():
            membership.join()
            state.on_reset()
        while True:
            try:
                state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                membership.grow()
                state.on_reset()
            except Exception as exc:
                if not _failed(exc):
                    raise
                lost = faults.failed(topology.get())
                state.restore()
                topology.shrink()
                if topology.size() < min_size:
                    raise SystemExit(
                        f"collectives.elastic: ranks {lost} failed and {topology.size()} are "
                        f"left, fewer than min_size={min_size}; ending the job. Its commits "
                        f"were in memory: go on from your last checkpoint on disk.") from exc
                state.on_reset()
                membership.replace_missing()

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
