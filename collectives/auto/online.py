"""`auto` checks its choice online: the first allreduces of each class too large to
ride in the agreement try every algorithm `auto` rates within CLOSE of the best, ROUNDS
turns of BURST calls each, and the class settles on the fastest for the rest of the job.
After every candidate's first turn, those over DROP x the fastest's turn leave the trial.
When the runner-up's fastest turn is within RUNOFF of the leader's, the two take
RUNOFF_TURNS more turns each, alternating, and the class settles on the one faster in most
of those pairs of neighbouring turns (the median of the pairs' ratios).

Why: the first job's measurement (autotune.py) lasts the seconds of `init`, and a slow
spell of a shared machine can cover all of it and give a size to the wrong algorithm for
good; trying again at the sizes the job calls, later and interleaved, corrects that at the
price of a few calls at a candidate's speed. The best of a few turns tells far-apart
candidates apart, not close ones, hence the runoff: neighbouring turns share the machine's
state, so a spell covering both cancels in their ratio. Trials compare whole calls as they
will run once settled: a candidate without a fast entry carries the general path's extra
cost, timed at init (_path()).

Every rank settles alike: a trial advances only in a call's data phase (on the engine, in
submission order) while no rank has joined (joined ranks run select.choose()'s algorithm),
and when it ends every rank takes the slowest rank's time per turn (one MPI allreduce). A
class's fast entry is registered only once the class has settled on its algorithm.

A settled class stays watched, because the machine changes under a job: every WATCH_S
seconds of its calls (a call count fixed when it settles, kept in _C.CallWatch, where the
fast entries count and time their calls) the ranks compare the best time since the last
review with the first review's; beyond DRIFT either way, or after RETRY_S seconds of calls
(later if a trial would cost over RETRY_SHARE of them), the class is tried again. The first
review also holds the winner to the runner-up's best turn in the trial: where even the best
of the winner's calls since is slower, the trial ran in a spell that favoured the winner (a
machine whose state flips can bring two candidates far apart in steady calls close together
for the trial's length), and the class is tried again at once, once per class and job (a
machine where every candidate runs slower settled than in a trial would otherwise try
forever). A join renews every watch (rejoined()). Settled classes are kept for later jobs
of the same setup (autotune.Memory); trial calls are counted apart in the stats
(`allreduce/<algorithm> (trial)`). A class is sizes within a factor of 4, in place or out
of place (select.size_class)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from collectives.algorithms import costmodel, shm
from collectives.auto import select, state
from collectives.auto.autotune import Memory
from collectives.kernels import _C
from collectives.runtime.engine import ENGINE, contributors
from collectives.runtime.topology import Topology

#: Candidates `auto` rates within this multiple of the best are tried: wide enough to take
#: in a candidate whose measurement at init fell in a slow spell of the machine, which can
#: put it several times its steady time.
CLOSE = 4.0
#: Turns per candidate in a trial (the fastest counts: interference only adds time).
ROUNDS = 3
#: Calls per turn, back to back; only the last is timed: the first after another
#: algorithm's call finds the caches full of that one's buffers and runs well above its
#: steady time, so timing it would measure the switch, not the algorithm.
BURST = 2
#: A runner-up whose fastest turn is within this multiple of the leader's goes to a runoff:
#: wide enough for two candidates whose turns' times overlap, which the best of ROUNDS
#: turns cannot order.
RUNOFF = 1.5
#: After every candidate's first turn, one whose turn took over this multiple of the
#: fastest's leaves the trial (further from the leader than a runoff reaches, with room
#: for one noisy turn): candidates far behind then cost one turn each instead of ROUNDS.
DROP = 2.0
#: Turns per finalist in a runoff: pairs enough for their median to outvote a spell of two.
RUNOFF_TURNS = 8
#: Seconds of a settled class's calls between reviews (at least MIN_WATCH calls). A review
#: costs a call's trip through Python and the engine's thread plus an allreduce, a fixed
#: cost per review: far enough apart for that to stay within the calls' noise, close
#: enough to notice a slow spell within a fraction of a second.
WATCH_S = 0.05
MIN_WATCH = 4
#: A settled class whose time changed more than this, either way, is tried again.
DRIFT = 1.5
#: A settled class is tried again after RETRY_S seconds of its calls, or later if its
#: trial would cost more than RETRY_SHARE of that time.
RETRY_S = 5.0
RETRY_SHARE = 0.05
#: Seconds of one call; replaced by tests to inject per-rank noise.
clock: Callable[[], float] = time.perf_counter


class Trial:
    """One class's running trial (or runoff): its candidates, the turns each takes,
    this rank's timed seconds per byte of each candidate's turns so far, the calls made,
    and the seconds that the class's trials before this one cost (a runoff's screening)."""

    __slots__ = ("candidates", "runoff", "times", "calls", "spent")

    def __init__(self, candidates: list[str], runoff: bool = False, spent: float = 0.0):
        self.candidates = candidates
        self.runoff = runoff
        self.times: list[list[float]] = [[] for _ in candidates]
        self.calls = 0
        self.spent = spent

    @property
    def turns(self) -> int:
        return RUNOFF_TURNS if self.runoff else ROUNDS


class Watch:
    """A settled class's watch: the count of its calls and their best time since the last
    review (native, shared with the class's fast entries), the slowest rank's best seconds
    per byte in the first review (its steady time: None before), calls per review, reviews
    left before the class is tried again, and the runner-up's best seconds per byte in the
    trial that settled the class (None: no trial, or the first review is not to check it)."""

    __slots__ = ("native", "steady", "window", "reviews_left", "rival")

    def __init__(self, window: int, reviews: int, rival: float | None = None):
        self.native = _C.CallWatch()
        self.native.renew(window)
        self.steady: float | None = None
        self.window = window
        self.reviews_left = reviews
        self.rival = rival


def checks(topo: Topology, nbytes: int) -> bool:
    """Whether `auto` allreduces of nbytes on topo are checked online (run() picks their
    algorithm when they run): the job measured its machine (a tuning file is the user's
    word; without measurement nothing is close) and the call does not ride in the
    agreement (a riding call runs the agreement's own algorithm, whatever its class); not
    in a frozen run (Config.frozen)."""
    return (topo.config.autotune and not topo.config.frozen and not topo.config.tuning_file
            and topo.size > 1 and nbytes > topo.channel.capacity)


def settled_on(topo: Topology, c: int, nbytes: int, inplace: bool, algorithm: str,
               entry: Any) -> bool:
    """Whether class c (of nbytes, in place or not) has settled on algorithm: a call
    described with it may take its fast entry from now on, which is put under the class's
    watch. (The call that ends a trial ran a candidate, which need not be the one the
    class settled on.)"""
    auto = state.of(topo)
    if c not in auto.settled or select.choose("allreduce", nbytes, topo, inplace) != algorithm:
        return False
    watch = auto.watches.get(c)
    entry.watch(None if watch is None else watch.native)
    return True


def rejoined(topo: Topology) -> None:
    """A join on topo ended (on every rank at once): renew every watch, as the joined ranks
    counted none of the calls made meanwhile."""
    for watch in state.of(topo).watches.values():
        watch.native.renew(watch.window)


def run(topo: Topology, c: int, nbytes: int, inplace: bool,
        reduce: Callable[[str], None]) -> None:
    """The data phase of an `auto` allreduce of nbytes (of class c: its size, in place or
    not) that checks() covers:
    reduce(algorithm) with a trial's candidate, else with `auto`'s choice. The choice is
    made here, in submission order, not when the call was described: a caller's thread may
    describe a call while the engine's settles its class."""
    joined = contributors(topo.size) < topo.size
    auto = state.of(topo)
    watch = None if joined else auto.watches.get(c)
    if watch is not None and not watch.native.take():  # due
        watch = _review(topo, c, watch)
    trial = None if joined or c in auto.settled else _trial(topo, c, nbytes)
    if trial is None:
        algo = select.choose("allreduce", nbytes, topo, inplace)
        ENGINE.native.credit(topo.stats, "allreduce", algo)
        start = clock()
        reduce(algo)
        if watch is not None:
            watch.native.record((clock() - start) / nbytes)
        return
    k = trial.calls // BURST % len(trial.candidates)
    algo = trial.candidates[k]
    ENGINE.native.credit(topo.stats, "allreduce", f"{algo} (trial)")
    start = clock()
    reduce(algo)
    if trial.calls % BURST == BURST - 1:
        trial.times[k].append((clock() - start) / nbytes)
    trial.calls += 1
    if trial.calls == trial.turns * BURST * len(trial.candidates):
        _end(topo, c, trial, nbytes)
    elif trial.calls == BURST * len(trial.candidates) and not trial.runoff:
        _screen(topo, c, trial, nbytes)


def _end(topo: Topology, c: int, trial: Trial, nbytes: int) -> None:
    """Class c's trial (or runoff) ended in this call (of nbytes): on the slowest rank's time
    per turn, begin a runoff between the two fastest when they are close, else settle on
    the winner and watch it. Agreed inputs only, so every rank decides and watches alike."""
    slowest = np.empty((len(trial.candidates), trial.turns))
    topo.comm.Allreduce(np.array(trial.times), slowest, op=MPI.MAX)
    spent = trial.spent + float(slowest.sum()) * nbytes * BURST
    slowest += _path(topo, trial.candidates, nbytes)[:, None]
    if trial.runoff:  # [leader, runner-up]: the runner-up wins most pairs, or not
        k = int(np.median(slowest[1] / slowest[0]) < 1)
        call = float(np.median(slowest[k])) * nbytes
        rival = float(slowest[1 - k].min())  # a best, like the review's
    else:
        best = slowest.min(axis=1)
        order = np.argsort(best, kind="stable")
        k = int(order[0])
        if best[order[1]] <= RUNOFF * best[k]:  # a trial has two candidates or more
            finalists = [trial.candidates[k], trial.candidates[order[1]]]
            state.of(topo).trials[c] = Trial(finalists, runoff=True, spent=spent)
            return
        call = float(best[k]) * nbytes
        rival = float(best[order[1]])
    _decide(topo, c, trial.candidates[k], call, spent, nbytes, rival)


def _screen(topo: Topology, c: int, trial: Trial, nbytes: int) -> None:
    """Class c's trial after every candidate's first turn (in this call, of nbytes): the
    candidates whose turn took over DROP x the fastest's (the slowest rank's times) leave
    it; the rest go on with their first turn counted. One left: the class settles on it."""
    first = np.empty(len(trial.candidates))
    topo.comm.Allreduce(np.array([t[0] for t in trial.times]), first, op=MPI.MAX)
    priced = first + _path(topo, trial.candidates, nbytes)
    keep = [k for k in range(len(first)) if priced[k] <= DROP * priced.min()]
    if len(keep) == len(first):
        return
    if len(keep) == 1:
        spent = trial.spent + float(first.sum()) * nbytes * BURST
        rival = min(float(priced[k]) for k in range(len(priced)) if k != keep[0])
        _decide(topo, c, trial.candidates[keep[0]], float(priced[keep[0]]) * nbytes, spent,
                nbytes, rival)
        return
    dropped = sum(float(first[k]) for k in range(len(first)) if k not in keep)
    spent = trial.spent + dropped * nbytes * BURST  # the rest's first turns count at the end
    rest = state.of(topo).trials[c] = Trial([trial.candidates[k] for k in keep], spent=spent)
    rest.times = [[float(first[k])] for k in keep]
    rest.calls = BURST * len(keep)


def _path(topo: Topology, candidates: list[str], nbytes: int) -> np.ndarray:
    """Seconds per byte to add to each candidate's timed data phase so that the trial
    compares whole calls as they will run once the class settles: a class settled on shm
    over a shared window runs its calls through the C++ fast entry, any other on the
    general path, which costs the measured general_path_s more per call (the call's
    description, the engine's thread and the algorithm's Python around its data phase).
    Zeros where no candidate has a fast entry (algorithms/shm.has_fast_entry). Calls that
    never take the fast entry, staged device data and bfloat16, are priced as if they did."""
    extra = costmodel.general_path_s() / max(nbytes, 1)
    fast = [shm.has_fast_entry(name, topo.channel.shared) for name in candidates]
    if not extra or not any(fast):
        return np.zeros(len(candidates))
    return np.array([0.0 if f else extra for f in fast])


def _decide(topo: Topology, c: int, algo: str, call: float, spent: float, nbytes: int,
            rival: float) -> None:
    """Class c settles on algo, whose calls of nbytes take `call` seconds, after trials that
    cost `spent`, where the runner-up's best turn took `rival` seconds per byte: watched,
    and kept for later jobs."""
    _settle(topo, c, algo)
    _watch(topo, c, call, spent, None if c in state.of(topo).rechecked else rival)
    memory: Memory | None = state.of(topo).memory
    if memory is not None:
        memory.remember(c, {"algorithm": algo, "seconds_per_byte": call / nbytes,
                            "spent": spent})


def _watch(topo: Topology, c: int, call: float, spent: float,
           rival: float | None = None) -> None:
    """Watch class c, just settled: its calls take `call` seconds, its trials cost
    `spent`, the runner-up's calls took `rival` seconds per byte (None: not checked)."""
    window = max(MIN_WATCH, math.ceil(WATCH_S / call))
    retry = max(RETRY_S, spent / RETRY_SHARE)
    state.of(topo).watches[c] = Watch(window, math.ceil(retry / (window * call)), rival)


def _review(topo: Topology, c: int, watch: Watch) -> Watch | None:
    """Class c's watch came due: the slowest rank's best time since the last review against
    the first review's (like against like: the best of a review's many calls runs well
    below a trial's best of ROUNDS, so a trial's time is no steady time), and in the first
    review against the runner-up's best turn in the trial (the winner's best call slower than
    that: the trial misjudged them). Renewed (and this call counted) when it held and
    reviews are left; else the class is tried again from this call (None)."""
    auto = state.of(topo)
    best = np.empty(1)
    topo.comm.Allreduce(np.array([watch.native.best]), best, op=MPI.MAX)
    misjudged = False
    if watch.steady is None and math.isfinite(best[0]):
        watch.steady = float(best[0])
        misjudged = watch.rival is not None and watch.steady > watch.rival
        if misjudged:
            auto.rechecked.add(c)
    drift = best[0] / watch.steady if watch.steady else 1.0  # inf: none timed (a join)
    watch.reviews_left -= 1
    if watch.reviews_left > 0 and not misjudged and (1 / DRIFT <= drift <= DRIFT
                                                      or math.isinf(drift)):
        watch.native.renew(watch.window)
        watch.native.take()
        return watch
    watch.native.renew(0)  # its fast entries decline from now on
    del auto.watches[c], auto.settled[c]
    state.changed(topo, entries=True)
    return None


def _trial(topo: Topology, c: int, nbytes: int) -> Trial | None:
    """Class c's trial, begun at its first call (of nbytes) if need be; None (and the class
    settled) when an earlier job of this setup settled it (the cache's entry, watched as
    if this job had tried it), or when only one candidate is close (on `auto`'s usual
    choice)."""
    auto = state.of(topo)
    trial = auto.trials.get(c)
    memory: Memory | None = auto.memory
    kept = None if trial is not None or memory is None else memory.recall(c)
    if kept is not None and kept["algorithm"] in select.candidates(topo):
        _settle(topo, c, kept["algorithm"])
        _watch(topo, c, kept["seconds_per_byte"] * nbytes, kept["spent"])
        return None
    if trial is None:
        estimates = select.estimates("allreduce", nbytes, topo)
        best = min(estimates.values())
        close = sorted(a for a, t in estimates.items() if t <= CLOSE * best)
        if len(close) < 2:
            _settle(topo, c, None)
            return None
        trial = auto.trials[c] = Trial(close)
    return trial


def _settle(topo: Topology, c: int, algo: str | None) -> None:
    """Class c runs algo from now on (None: select.choose()'s estimate per size). Calls
    described under the old choice are described again (their fast entries, registered
    only once a class has settled and only for the algorithm it settled on, stay valid)."""
    auto = state.of(topo)
    auto.trials.pop(c, None)
    auto.settled[c] = algo
    state.changed(topo, entries=False)
