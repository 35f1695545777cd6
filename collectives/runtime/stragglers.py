"""Stragglers: the rank the others wait for, named in one warning.

Every call's agreement carries each rank's arrival on the job's clock (csrc/runtime/agree.h)
and credits the rank that arrived last with the others' waits, together: the job
communicator's counters hold the seconds per rank (collectives.stats()["waited_for"]). A
rank slow before its calls hides behind the others' waits in step times (every rank's
step takes as long as the slowest's); here it stands out.

Rank 0 watches: at the end of each window (config.straggler_window_s) it takes the rank
credited most in it, and where that rank cost the others more than config.straggler_share
of their time (its seconds over (size - 1) x the window), logs one warning naming it, the
share and the window. It stays quiet while the same rank stays the straggler, and says so
once when none is. Cost: reading the counters once a window, on the watchdog's thread."""

from __future__ import annotations

import logging
import time
from itertools import zip_longest
from typing import Any

log = logging.getLogger("collectives")


class Stragglers:
    """The watch over one communicator's waits (stats: its _C.Stats, size ranks)."""

    def __init__(self, stats: Any, size: int, share: float, window_s: float):
        if not 0 < share <= 1:
            raise ValueError(f"COLLECTIVES_STRAGGLER_SHARE: expected a share in (0, 1], "
                             f"got {share!r}")
        if not window_s > 0:
            raise ValueError(f"COLLECTIVES_STRAGGLER_WINDOW_S: expected seconds > 0, got "
                             f"{window_s!r}")
        self.stats, self.size, self.share, self.window_s = stats, size, share, window_s
        self._since = time.monotonic()
        self._base: list[float] = stats.waits()
        self.named: int | None = None  # the rank last warned of, while it stays one

    def tick(self) -> None:
        """At a window's end: warn of a new straggler, or note that there is none now."""
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < self.window_s or self.size < 2:
            return
        waits = self.stats.waits()
        spent = [w - b for w, b in zip_longest(waits, self._base, fillvalue=0.0)]
        self._since, self._base = now, waits
        rank = max(range(len(spent)), key=spent.__getitem__) if spent else None
        share = 0.0 if rank is None else spent[rank] / ((self.size - 1) * elapsed)
        if share > self.share:
            if rank != self.named:
                log.warning("collectives straggler: the other ranks spent %.0f%% of their time "
                            "in the last %.0f s waiting for rank %d (%.1f s together); "
                            "collectives.stats()['waited_for'] has each rank's seconds",
                            100 * share, elapsed, rank, spent[rank])
            self.named = rank
        elif self.named is not None:
            log.warning("collectives straggler: rank %d no longer holds the others back "
                        "(%.0f%% of their time in the last %.0f s)", self.named, 100 * share,
                        elapsed)
            self.named = None
