"""What an elastic job keeps across a failure (Horovod's State and ObjectState).

A State is committed in memory by every rank (`commit`, cheap enough to call every step),
restored by every survivor after a failure (`restore`), made alike from rank 0 (`sync`, at
the start of `run` and after every shrink), and told when the job shrank (`on_reset`, which
runs the user's reset callbacks)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from collectives.api.gather import broadcast_object
from collectives.elastic import membership


class State:
    """The base of elastic states: subclasses say how to save, restore and sync what they
    hold. bcast_object(obj, root_rank) (Horovod's argument) defaults to collectives'
    broadcast_object; get_rank, Horovod's other argument, is accepted for its signature
    (sync always takes rank 0's state)."""

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None):
        self._bcast_object = broadcast_object if bcast_object is None else bcast_object
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of callbacks() after the job shrank, before the state is synced (to
        rescale the learning rate by the new size, re-partition data, ...)."""
        if not all(callable(cb) for cb in callbacks):
            raise TypeError("callbacks: expected a list of callables")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """The job shrank: reset what depends on its size, then run the reset callbacks."""
        self.reset()
        for cb in self._reset_callbacks:
            cb()

    def commit(self) -> None:
        """Keep the current state in memory: a failure from here on restores it. Where
        replacements wait to join, raises HostsUpdatedInterrupt (on every rank) after
        saving, for run to take them in."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod's check for ranks that join: raise HostsUpdatedInterrupt on every rank if
        replacements are ready (collective while the job is below its target size)."""
        membership.check()

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

    def _set_attrs(self) -> None:
        for k, v in copy.deepcopy(self._saved).items():
            setattr(self, k, v)
