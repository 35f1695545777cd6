"""`auto` checks its choice online: the first allreduces of each size class too large to
ride in the agreement try every algorithm `auto` rates within CLOSE of the best, ROUNDS
turns of BURST calls each, and the class settles on the fastest for the rest of the job.

Why: the first job's measurement (autotune.py) runs in the two or three seconds of `init`,
and on a shared machine a slow spell can cover all of it; one in three fresh jobs here
measured shm's 16-64 MiB allreduce 2.4-3x slow and handed those sizes to ring for good.
Trying again at the sizes the job actually calls, later and interleaved, corrects that at
the price of a few calls at a candidate's speed.

Every rank settles the same way: each times its own calls, and when a class's trial ends
every rank takes the slowest rank's time per candidate (one MPI allreduce of a few floats,
inside that call). The trial's state advances only in the call's data phase (on the engine,
in submission order, after the agreement), and only while no rank has joined: a joined rank
(join.py) runs select.choose()'s algorithm, so a call made while some rank has joined runs
that one on every rank and counts for no trial. Every call of a checked class picks its
algorithm in its data phase too (run()), and its fast entry, which runs the algorithm it
was described with, is registered there only once the class has settled on that algorithm:
so no call runs a choice its description made before the class settled.

Size classes are factors of 4 (select.size_class); those holding a size that rides are
left to the first measurement. Cost: ROUNDS x BURST x candidates calls per class, each at most
CLOSE x the estimated best's time (as far as the estimate holds), and one allreduce when
the class settles."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from . import select
from .engine import ENGINE
from .topology import Topology

#: Candidates `auto` rates within this multiple of the best are tried: wide enough for a
#: measurement taken in a slow spell (shm's 64 MiB allreduce measured 3.7x its steady time
#: at one init, which a factor of 2 left out of the trial).
CLOSE = 4.0
#: Turns per candidate in a trial (the fastest counts: interference only adds time).
ROUNDS = 3
#: Calls per turn, back to back; only the last is timed: the first after another
#: algorithm's call finds the caches full of that one's buffers (at 256 KiB such calls
#: ran 2-5x their steady time and made the trial a coin toss).
BURST = 2
#: Seconds of one call; replaced by tests to inject per-rank noise.
clock: Callable[[], float] = time.perf_counter


class Trial:
    """One size class's running trial: its candidates, each one's best seconds per byte so
    far on this rank, and the calls made."""

    __slots__ = ("candidates", "best", "calls")

    def __init__(self, candidates: list[str]):
        self.candidates = candidates
        self.best = [math.inf] * len(candidates)
        self.calls = 0


def checks(topo: Topology, nbytes: int) -> bool:
    """Whether `auto` allreduces of nbytes on topo are checked online (run() picks their
    algorithm when they run): the job measured its machine (a tuning file is the user's
    word; without measurement nothing is close) and no size of the class rides in the
    agreement."""
    return (topo.config.autotune and not topo.config.tuning_file and topo.size > 1
            and select.class_floor(select.size_class(nbytes)) > topo.channel.capacity)


def settled(topo: Topology, nbytes: int) -> bool:
    """Whether nbytes' class has settled: its algorithm will not change."""
    return select.size_class(nbytes) in topo.settled


def settled_on(topo: Topology, nbytes: int, algorithm: str) -> bool:
    """Whether nbytes' class has settled on algorithm: a call described with it may take its
    fast entry from now on. (The call that ends a trial ran a candidate, which need not be
    the one the class settled on.)"""
    return settled(topo, nbytes) and select.choose("allreduce", nbytes, topo) == algorithm


def run(topo: Topology, nbytes: int, reduce: Callable[[str], None]) -> None:
    """The data phase of an `auto` allreduce of nbytes that checks() covers:
    reduce(algorithm) with a trial's candidate, else with `auto`'s choice. The choice is
    made here, in submission order, not when the call was described: a caller's thread may
    describe a call while the engine's settles its class."""
    c = select.size_class(nbytes)
    trial = None if ENGINE.native.joined or c in topo.settled else _trial(topo, c, nbytes)
    if trial is None:
        algo = select.choose("allreduce", nbytes, topo)
        ENGINE.native.credit(topo.stats, "allreduce", algo)
        reduce(algo)
        return
    k = trial.calls // BURST % len(trial.candidates)
    algo = trial.candidates[k]
    ENGINE.native.credit(topo.stats, "allreduce", algo)
    start = clock()
    reduce(algo)
    if trial.calls % BURST == BURST - 1:
        trial.best[k] = min(trial.best[k], (clock() - start) / nbytes)
    trial.calls += 1
    if trial.calls == ROUNDS * BURST * len(trial.candidates):
        slowest = np.empty(len(trial.best))
        topo.comm.Allreduce(np.array(trial.best), slowest, op=MPI.MAX)
        _settle(topo, c, trial.candidates[int(np.argmin(slowest))])


def _trial(topo: Topology, c: int, nbytes: int) -> Trial | None:
    """Class c's trial, begun at its first call (of nbytes) if need be; None (and the class
    settled on `auto`'s usual choice) when only one candidate is close."""
    trial = topo.trials.get(c)
    if trial is None:
        estimates = select.estimates("allreduce", nbytes, topo)
        best = min(estimates.values())
        close = sorted(a for a, t in estimates.items() if t <= CLOSE * best)
        if len(close) < 2:
            _settle(topo, c, None)
            return None
        trial = topo.trials[c] = Trial(close)
    return trial


def _settle(topo: Topology, c: int, algo: str | None) -> None:
    """Class c runs algo from now on (None: select.choose()'s estimate per size). Calls
    described under the old choice are described again (their fast entries, registered
    only once a class has settled and only for the algorithm it settled on, stay valid)."""
    topo.trials.pop(c, None)
    topo.settled[c] = algo
    topo.calls.clear()
