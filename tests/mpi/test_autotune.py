"""`auto` out of the box (collectives/auto/autotune.py): the first job on a setup measures and
caches, the next reads the cache; tuning-file errors at init; every rank makes the same
choices however noisy its own clock."""

from __future__ import annotations

import hashlib
import json
import math
import time
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_equal

import collectives as C
from collectives import algorithms, config
from collectives.algorithms import costmodel
from collectives.api import calls, timed_call
from collectives.auto import autotune, online, select, state
from collectives.runtime import topology

SMALL = (8, 4 << 10)  # sizes that keep a test's measurement short


def _job(generation: int = 0, **options) -> types.SimpleNamespace:
    """The job's topology with other options (generation: shrinks after failures)."""
    job = topology.get()
    return types.SimpleNamespace(comm=job.comm, rank=job.rank, size=job.size, nodes=job.nodes,
                                 channel=job.channel, config=config.Config(**options),
                                 generation=generation)


@pytest.fixture
def cache(tmp_path_factory, comm, monkeypatch):
    """An empty cache directory, the same on every rank; small measurements."""
    root = comm.bcast(str(tmp_path_factory.mktemp("cache")) if comm.rank == 0 else None)
    monkeypatch.setenv("XDG_CACHE_HOME", root)
    monkeypatch.setattr(autotune, "SIZES", SMALL)
    return root


def _unmeasured(*call):
    """A `timed` for a setup that must measure nothing: asked for any call, it fails."""
    raise AssertionError(f"measured {call[:1]}, expected the cache or nothing")


def test_a_single_rank_has_nothing_to_measure(cache):
    job = _job()
    job.size = 1  # as at np 1 (checked before the communicator is used)
    assert autotune.setup(job, _unmeasured) == {}  # nothing to choose between


@pytest.mark.mpi(min_size=2)
def test_the_first_job_measures_and_the_next_reads_the_cache(comm, cache):
    first = autotune.setup(_job(), timed_call)
    assert first["nodes"] == [len(n) for n in topology.get().nodes]
    assert set(first["measured"]) == set(autotune.COLLECTIVES)
    assert all(len(points) == len(SMALL) for table in first["measured"].values()
               for points in table.values())
    path = autotune.cache_path(autotune.key(topology.get()))
    assert str(path).startswith(cache) and (comm.rank != 0 or path.exists())
    again = autotune.setup(_job(), _unmeasured)
    assert again == json.loads(json.dumps(first))


@pytest.mark.mpi(min_size=2)
def test_a_shrunk_job_reads_the_cache_but_does_not_measure(comm, cache):
    """After a failure (collectives.elastic) the job goes on at once: on the cache of its
    new setup if there is one, else on the model."""
    assert autotune.setup(_job(generation=1), _unmeasured) == {}
    measured = autotune.setup(_job(), timed_call)
    assert autotune.setup(_job(generation=1), _unmeasured) == json.loads(json.dumps(measured))


@pytest.mark.mpi(min_size=2)
def test_a_slow_link_stops_the_sweep_within_its_budget(comm, cache, monkeypatch):
    """Over a 10 Mbit/s link (every call takes its bytes at 1.25 MB/s, the slower the
    further rank 1 is from rank 0's clock) the sweep times the sizes whose calls fit in
    BUDGET_S and leaves the rest to the last bandwidth: the same sizes on every rank,
    within the budget, and `auto` still chooses at 64 MiB, alike on every rank."""
    now = [0.0]

    def slow(collective, x, algorithm, *name):
        def call() -> None:
            now[0] += (20e-6 + x.nbytes / 1.25e6) * (1 + 0.1 * comm.rank)
        return call

    monkeypatch.setattr(autotune, "clock", lambda: now[0])
    monkeypatch.setattr(autotune, "SIZES", (8, 4 << 10, 64 << 10, 256 << 10, 1 << 20,
                                            16 << 20, 64 << 20))
    tuning = autotune.setup(_job(), slow)
    for collective, table in tuning["measured"].items():
        sizes = {tuple(b for b, _ in points) for points in table.values()}
        assert len(sizes) == 1, (collective, sizes)
        (sizes,) = sizes
        assert sizes == autotune.SIZES[:len(sizes)] and 2 <= len(sizes) < 6, (collective, sizes)
        spent = sum(autotune.sweep_seconds({a: dict(map(tuple, points))[b]
                                            for a, points in table.items()}, b) for b in sizes)
        assert spent <= autotune.BUDGET_S, (collective, spent)
    assert len(set(comm.allgather(json.dumps(tuning["measured"], sort_keys=True)))) == 1
    monkeypatch.setattr(costmodel, "_installed", tuning)
    select.estimates_changed()
    try:
        choices = [select.choose(c, 64 << 20, topology.get()) for c in autotune.COLLECTIVES]
        assert len({tuple(x) for x in comm.allgather(choices)}) == 1
    finally:
        select.estimates_changed()


def test_the_key_names_what_the_times_depend_on(comm):
    k = autotune.key(topology.get())
    assert k["world_size"] == comm.Get_size() and k["version"] == autotune.version()
    assert sum(k["nodes"]) == comm.Get_size() and len(k["hosts"]) == len(k["nodes"])
    paths = {autotune.cache_path({**k, field: "other"}) for field in k}
    assert autotune.cache_path(k) not in paths and len(paths) == len(k)


def test_a_tuning_file_that_is_missing_or_bad_is_an_error_at_init(comm, tmp_path):
    missing = comm.bcast(str(tmp_path / "nowhere.json") if comm.rank == 0 else None)
    with pytest.raises(ValueError, match=f"COLLECTIVES_TUNING_FILE={missing}: no such file"):
        autotune.setup(_job(tuning_file=missing), timed_call)
    bad = comm.bcast(str(tmp_path / "bad.json") if comm.rank == 0 else None)
    if comm.rank == 0:
        with open(bad, "w") as f:
            f.write("{not json")
    comm.Barrier()
    with pytest.raises(ValueError, match=f"COLLECTIVES_TUNING_FILE={bad}: not a tuning file"):
        autotune.setup(_job(tuning_file=bad), timed_call)


def test_a_tuning_file_for_another_layout_warns_and_is_set_aside(comm, tmp_path):
    other = comm.bcast(str(tmp_path / "other.json") if comm.rank == 0 else None)
    if comm.rank == 0:
        with open(other, "w") as f:
            json.dump({"nodes": [comm.Get_size() + 1], "measured": {}}, f)
    comm.Barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert autotune.setup(_job(tuning_file=other, autotune=False), timed_call) == {}
    assert any("made for nodes" in str(w.message) for w in caught) == (comm.rank == 0)


@pytest.mark.mpi(min_size=2)
def test_every_rank_chooses_the_same_under_per_rank_noise(comm, cache, monkeypatch):
    clock = time.perf_counter
    noise = iter(range(10 ** 6))

    def jittery() -> float:  # each rank's clock runs off by its own amount
        return clock() + (comm.rank + 1) * 1e-4 * (next(noise) % 7)

    monkeypatch.setattr(autotune, "clock", jittery)
    tuning = autotune.setup(_job(), timed_call)
    digest = hashlib.sha256(json.dumps(tuning["measured"], sort_keys=True).encode()).hexdigest()
    assert len(set(comm.allgather(digest))) == 1
    monkeypatch.setattr(costmodel, "_installed", tuning)
    select.estimates_changed()
    try:
        choices = [select.choose(c, s, topology.get()) for c in autotune.COLLECTIVES
                   for s in (8, 1 << 10, 1 << 12, 1 << 20)]
        assert len({tuple(x) for x in comm.allgather(choices)}) == 1
        assert C.allreduce(np.full(3, C.rank() + 1.0), op=C.Sum)[0] == \
            sum(range(1, comm.Get_size() + 1))
    finally:
        select.estimates_changed()


# ----------------------------------------------------- online.py: `auto` checks its choice

@pytest.fixture
def trials(monkeypatch):
    """No class settled or on trial, and a topology that tries online (the job's config
    measures, with no tuning file): this test's calls begin every trial."""
    topo = topology.get()
    auto = state.of(topo)
    monkeypatch.setattr(auto, "trials", {})
    monkeypatch.setattr(auto, "settled", {})
    monkeypatch.setattr(auto, "watches", {})
    monkeypatch.setattr(auto, "rechecked", set())
    monkeypatch.setattr(auto, "memory", None)  # the user's cache is not this test's
    monkeypatch.setattr(topo, "config", config.Config())
    select.estimates_changed()
    yield topo
    select.estimates_changed()
    calls.forget(topo, entries=True)


def _tried(topo) -> int:
    """A float64 count too large to ride in the agreement: it is tried online (its class
    also holds sizes that ride)."""
    count = topo.channel.capacity // 8 + 1
    assert online.checks(topo, 8 * count) and not online.checks(topo, 8 * count - 8)
    return count


def _estimates(close: dict[str, float]):
    """select.estimates() rating the algorithms in close as given, every other one far off."""
    def estimates(collective, nbytes, topo):
        return {**{a: 100.0 for a in select.candidates(topo)}, **close}
    return estimates


def _fake_time(monkeypatch, seconds) -> None:
    """online's clock reads a fake time that each reduction run in Python by algorithm a
    advances by seconds(a) (the test's choice, per rank), whatever the call's role."""
    now = [0.0]
    reduce = algorithms.reduce

    def timed(algo, *args, **kwargs):
        reduce(algo, *args, **kwargs)
        now[0] += seconds(algo)

    monkeypatch.setattr(algorithms, "reduce", timed)
    monkeypatch.setattr(online, "clock", lambda: now[0])


def _runs(*algos: str, trial: bool | None = None) -> dict[str, int]:
    """Allreduce calls run so far per algorithm: trial calls (trial=True), the others
    (False), or both (None)."""
    per_op = C.stats()["per_op"]
    keys = {None: ("", " (trial)"), True: (" (trial)",), False: ("",)}[trial]
    return {a: sum(per_op.get(f"allreduce/{a}{k}", {}).get("calls", 0) for k in keys)
            for a in algos}


@pytest.mark.mpi(min_size=2)
def test_online_trial_settles_on_the_slowest_ranks_fastest(comm, trials, monkeypatch):
    """A class whose close candidates are mpi and ring: they take ROUNDS turns of BURST calls;
    rank 0 alone finds mpi faster, the others find ring faster and are slower overall, so
    ring leads (the slowest rank's times decide); mpi is within RUNOFF, so the two take
    RUNOFF_TURNS turns more, and every rank settles on ring; every result exact."""
    monkeypatch.setattr(select, "estimates", _estimates({"ring": 1.0, "mpi": 1.5}))
    n, r = comm.Get_size(), comm.Get_rank()
    seconds = {"mpi": 1.0, "ring": 2.0} if r == 0 else {"mpi": 3.0, "ring": 2.5}
    _fake_time(monkeypatch, seconds.get)
    x = np.full(_tried(trials), float(r + 1))
    c = select.size_class(x.nbytes)
    before = _runs("mpi")["mpi"]
    turn = online.BURST
    for i in range((online.ROUNDS + online.RUNOFF_TURNS) * turn * 2):
        assert c not in state.of(trials).settled
        assert_equal(C.allreduce(x, op=C.Sum), np.full(x.size, n * (n + 1) / 2.0), f"call {i}")
        if i == online.ROUNDS * turn * 2 - 1:
            trial = state.of(trials).trials[c]
            assert trial.runoff and trial.candidates == ["ring", "mpi"]
    assert state.of(trials).settled[c] == "ring" and c not in state.of(trials).trials
    assert _runs("mpi")["mpi"] == before + (online.ROUNDS + online.RUNOFF_TURNS) * turn
    assert select.choose("allreduce", x.nbytes, trials) == "ring"
    assert select.choose("allreduce", x.nbytes * 2, trials) == "ring"  # the whole class
    assert select.size_class(x.nbytes * 8) not in state.of(trials).settled  # not the next class
    assert_equal(C.allreduce(x, op=C.Sum), np.full(x.size, n * (n + 1) / 2.0), "settled")


def _mpi_fast_at_first(later: float):
    """Seconds per call: ring 1.2; mpi 1 in its first turn, later after."""
    mpi_calls = [0]

    def seconds(algo: str) -> float:
        if algo == "ring":
            return 1.2
        mpi_calls[0] += 1
        return 1.0 if mpi_calls[0] <= online.BURST else later

    return seconds


@pytest.mark.mpi(min_size=2)
def test_a_runoff_settles_on_the_finalist_faster_in_most_pairs(comm, trials, monkeypatch):
    """mpi's first timed turn is the fastest of the trial (1 s, then 2 s a call), ring's
    take 1.2 s: mpi leads on its best turn, ring is within RUNOFF, and ring is faster in
    every pair of the runoff, so the class settles on ring. With mpi at 1.1 s after its
    first turn (in another class), mpi wins."""
    monkeypatch.setattr(select, "estimates", _estimates({"ring": 1.0, "mpi": 1.5}))
    for i, (later, want) in enumerate(((2.0, "ring"), (1.1, "mpi"))):
        _fake_time(monkeypatch, _mpi_fast_at_first(later))
        x = np.full(_tried(trials) * 4 ** i, comm.Get_rank() + 1.0)
        c = select.size_class(x.nbytes)
        _calls(comm, x, online.ROUNDS * online.BURST * 2)
        assert state.of(trials).trials[c].runoff and state.of(trials).trials[c].candidates == ["mpi", "ring"]
        _calls(comm, x, online.RUNOFF_TURNS * online.BURST * 2)
        assert state.of(trials).settled[c] == want and not state.of(trials).trials, later


@pytest.mark.mpi(min_size=2)
def test_a_frozen_run_tries_nothing_online(comm, trials, monkeypatch):
    """With Config.frozen a class whose candidates are close runs the model's choice on
    every call: no trial call, and nothing settled (the same class tries ring and mpi
    without it)."""
    monkeypatch.setattr(select, "estimates", _estimates({"ring": 1.0, "mpi": 1.5}))
    x = np.full(_tried(trials), comm.Get_rank() + 1.0)
    monkeypatch.setattr(trials, "config", config.Config(frozen=True))
    before = _runs("ring", "mpi", trial=True)
    _calls(comm, x, online.ROUNDS * online.BURST * 2)
    assert _runs("ring", "mpi", trial=True) == before
    assert not state.of(trials).trials and not state.of(trials).settled


@pytest.mark.mpi(min_size=2)
def test_a_frozen_run_reads_the_cache_but_does_not_measure(comm, cache):
    assert autotune.setup(_job(frozen=True), _unmeasured) == {}
    measured = autotune.setup(_job(), timed_call)
    assert autotune.setup(_job(frozen=True), _unmeasured) == json.loads(json.dumps(measured))


@pytest.mark.mpi(min_size=2)
def test_a_trial_prices_the_general_path_against_a_fast_entry(comm, trials, monkeypatch):
    """On one node shm's class runs through its C++ fast entry once settled, mpi's through
    the general path: with the general path measured at 0.5 s a call, mpi's 1.0 s data
    phases price at 1.5 against shm's 1.2, and the class settles on shm (after a runoff,
    within RUNOFF); measured at 0, mpi wins the same trial."""
    if not trials.channel.shared:
        pytest.skip("shm's fast entry needs the ranks on one node")
    monkeypatch.setattr(select, "estimates", _estimates({"shm": 1.0, "mpi": 1.0}))
    _fake_time(monkeypatch, {"shm": 1.2, "mpi": 1.0}.get)
    for i, (path_s, want) in enumerate(((0.5, "shm"), (0.0, "mpi"))):
        monkeypatch.setattr(costmodel, "general_path_s", lambda s=path_s: s)
        x = np.full(_tried(trials) * 4 ** i, comm.Get_rank() + 1.0)
        c = select.size_class(x.nbytes)
        _calls(comm, x, (online.ROUNDS + online.RUNOFF_TURNS) * online.BURST * 2)
        assert state.of(trials).settled[c] == want and not state.of(trials).trials, path_s


def test_the_general_path_is_measured_against_the_fast_entry(comm):
    """autotune.general_path: a named allreduce (the general path) against the same call
    through its fast entry, the slowest rank's; 0 where there is no shared fast entry."""
    topo = topology.get()
    seconds = autotune.general_path(topo, timed_call)
    assert seconds >= 0.0
    if not topo.channel.shared or topo.size == 1:
        assert seconds == 0.0
    assert comm.allgather(seconds) == [seconds] * comm.Get_size()


@pytest.mark.mpi(min_size=2)
def test_settled_class_runs_its_choice_after_a_trial_ending_on_another(comm, trials,
                                                                       monkeypatch):
    """Calls described with shm (the estimates' best, which has a C++ fast entry) whose trial
    ends on a shm call and settles on ring: every later call runs ring, none takes shm's
    fast entry."""
    if "shm" not in select.candidates(trials):
        pytest.skip("shm runs on one node only")
    monkeypatch.setattr(select, "estimates", _estimates({"shm": 1.0, "ring": 1.5}))
    _fake_time(monkeypatch, {"ring": 1.0, "shm": 2.0}.get)
    n, r = comm.Get_size(), comm.Get_rank()
    x = np.full(_tried(trials), float(r + 1))
    assert select.choose("allreduce", x.nbytes, trials) == "shm"
    for _ in range(online.ROUNDS * online.BURST * 2):  # the last turn is shm's
        C.allreduce(x, op=C.Sum)
    assert state.of(trials).settled == {select.size_class(x.nbytes): "ring"}
    riding = trials.channel.capacity  # of the same class, but riding: not settled
    assert select.size_class(riding) == select.size_class(x.nbytes)
    assert select.choose("allreduce", riding, trials) == "shm"
    before = _runs("ring", "shm")
    for i in range(online.MIN_WATCH):  # within the watch's first window
        assert_equal(C.allreduce(x, op=C.Sum), np.full(x.size, n * (n + 1) / 2.0), f"call {i}")
    assert _runs("ring", "shm") == {"ring": before["ring"] + online.MIN_WATCH,
                                    "shm": before["shm"]}


def _settle_ring_over_mpi(comm, trials, monkeypatch, seconds: dict) -> np.ndarray:
    """A class tried between ring and mpi and settled on ring at seconds' times (ring 1 s,
    mpi 2 s a call on every rank); returns the x of its calls (rank + 1 everywhere)."""
    monkeypatch.setattr(select, "estimates", _estimates({"ring": 1.0, "mpi": 1.5}))
    seconds.update(ring=1.0, mpi=2.0)
    x = np.full(_tried(trials), comm.Get_rank() + 1.0)
    for _ in range(online.ROUNDS * online.BURST * 2):
        C.allreduce(x, op=C.Sum)
    c = select.size_class(x.nbytes)
    assert state.of(trials).settled == {c: "ring"}
    assert state.of(trials).watches[c].window == online.MIN_WATCH  # 1 s calls: the fewest
    return x


def _calls(comm, x: np.ndarray, count: int, joined: int = 0) -> None:
    """count calls of x (rank + 1 everywhere) while ranks 0..joined-1 have joined."""
    n = comm.Get_size()
    want = n * (n + 1) // 2 - joined * (joined + 1) // 2
    for i in range(count):
        assert_equal(C.allreduce(x, op=C.Sum), np.full(x.size, float(want)), f"call {i}")


@pytest.mark.mpi(min_size=2)
def test_a_settled_class_is_tried_again_when_its_time_drifts(comm, trials, monkeypatch):
    """Settled on ring; the first review takes the steady time (1 s a call) and renews the
    watch; then ring slows to 4 s a call on the last rank alone: the next review (the
    slowest rank's time) tries the class again, and every rank settles on mpi. A join in
    between (rank 0's, while the others call) does not put the ranks' counts out of step."""
    seconds: dict[str, float] = {}
    r, last = comm.Get_rank(), comm.Get_size() - 1
    _fake_time(monkeypatch, lambda a: seconds[a])
    x = _settle_ring_over_mpi(comm, trials, monkeypatch, seconds)
    c = select.size_class(x.nbytes)
    watch = state.of(trials).watches[c]
    _calls(comm, x, online.MIN_WATCH + 1)  # the last one is due: reviewed, renewed
    assert state.of(trials).settled[c] == "ring" and watch.native.left == online.MIN_WATCH - 1
    if r != 0:
        _calls(comm, x, 5, joined=1)
    C.join()
    assert watch.native.left == online.MIN_WATCH  # renewed on every rank
    if r == last:
        seconds["ring"] = 4.0
    _calls(comm, x, online.MIN_WATCH)
    assert state.of(trials).settled[c] == "ring"
    before = _runs("mpi")["mpi"]
    _calls(comm, x, online.ROUNDS * online.BURST * 2)  # due: reviewed, tried again
    assert state.of(trials).settled == {c: "mpi"} and state.of(trials).watches[c] is not watch
    assert _runs("mpi")["mpi"] == before + online.ROUNDS * online.BURST
    assert watch.native.left == 0  # the old watch is closed
    assert len({tuple(s.items()) for s in comm.allgather(dict(state.of(trials).settled))}) == 1


@pytest.mark.mpi(min_size=2)
def test_a_class_whose_winner_runs_slower_than_the_runner_up_ran_is_tried_again(
        comm, trials, monkeypatch):
    """Settled on ring (1 s a call in the trial, mpi 2 s); from then on ring takes 3.5 s:
    the first review finds even its best call slower than mpi was in the trial, so the
    trial misjudged them and the class is tried again at once, settling on mpi. Once only:
    mpi's calls then take 4 s, slower than ring's 3.5 in that trial, and the class stays on
    mpi (the ordinary reviews watch it from there)."""
    seconds: dict[str, float] = {}
    _fake_time(monkeypatch, lambda a: seconds[a])
    x = _settle_ring_over_mpi(comm, trials, monkeypatch, seconds)
    c = select.size_class(x.nbytes)
    seconds["ring"] = 3.5
    _calls(comm, x, online.MIN_WATCH)
    assert state.of(trials).settled == {c: "ring"}
    _calls(comm, x, online.ROUNDS * online.BURST * 2)  # the first review's call begins a trial
    assert state.of(trials).settled == {c: "mpi"}
    seconds["mpi"] = 4.0
    _calls(comm, x, 2 * online.MIN_WATCH + 1)  # two reviews: the first renews the watch
    assert state.of(trials).settled == {c: "mpi"} and c not in state.of(trials).trials


@pytest.mark.mpi(min_size=2)
def test_a_settled_class_is_tried_again_when_its_reviews_run_out(comm, trials, monkeypatch):
    """Settled on ring, whose time then holds while mpi gets faster (which no review sees):
    once the class has run long enough (RETRY_S, RETRY_SHARE), it is tried again and settles
    on mpi."""
    seconds: dict[str, float] = {}
    _fake_time(monkeypatch, lambda a: seconds[a])
    # a trial of 6 x (1 + 2) s over reviews of 4 x 1 s: 2 reviews at this share
    monkeypatch.setattr(online, "RETRY_S", 0.0)
    monkeypatch.setattr(online, "RETRY_SHARE", 2.5)
    x = _settle_ring_over_mpi(comm, trials, monkeypatch, seconds)
    c = select.size_class(x.nbytes)
    assert state.of(trials).watches[c].reviews_left == 2
    seconds["mpi"] = 0.5
    _calls(comm, x, online.MIN_WATCH + 1)  # one review: renewed
    assert state.of(trials).settled[c] == "ring"
    _calls(comm, x, online.MIN_WATCH + online.ROUNDS * online.BURST * 2)
    assert state.of(trials).settled == {c: "mpi"}


@pytest.mark.mpi(min_size=2)
def test_watched_fast_entries_under_reviews_trials_and_a_join(comm, trials, monkeypatch):
    """A class settled on shm, whose calls take the C++ fast entry (which counts them against
    the watch in C++ and times them): a trial every second review (RETRY_SHARE), so calls go
    from the fast entry to reviews to trials and back (only if the fast entry counts its
    calls); rank 0 joins for a while. No hang, every result exact, and every rank ends with
    the same table."""
    if "shm" not in select.candidates(trials):
        pytest.skip("shm runs on one node only")
    monkeypatch.setattr(select, "estimates", _estimates({"shm": 1.0, "ring": 1.5}))
    _fake_time(monkeypatch, {"ring": 2.0, "shm": 1.0}.get)
    monkeypatch.setattr(online, "RETRY_S", 0.0)
    monkeypatch.setattr(online, "RETRY_SHARE", 2.5)  # 6 x (1 + 2) s over 4 x 1 s: 2 reviews
    n, r = comm.Get_size(), comm.Get_rank()
    x = np.full(_tried(trials), float(r + 1))
    fast, watches = 0, set()
    for i in range(90):
        joined = 25 <= i < 33  # rank 0 joins at 25, the others at 33
        if i == (25 if r == 0 else 33):
            C.join()
        if joined and r == 0:
            continue
        start = online.clock()
        want = n * (n + 1) / 2.0 - joined
        assert_equal(C.allreduce(x, op=C.Sum), np.full(x.size, want), f"call {i}")
        fast += online.clock() == start  # no reduction in Python: the fast entry
        watches.add(state.of(trials).watches.get(select.size_class(x.nbytes)))
    # settled, fast, due, tried again, settled...: several settlings, each with its watch
    assert fast > 0 and len(watches - {None}) >= 3
    table = (dict(state.of(trials).settled), {k: w.native.left for k, w in state.of(trials).watches.items()})
    assert len({repr(t) for t in comm.allgather(table)}) == 1


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mpi_s", [2.5, 1.8])
def test_candidates_far_behind_after_one_turn_leave_the_trial(comm, trials, monkeypatch, mpi_s):
    """ring 1 s, tree 3 s a call, mpi mpi_s: after one turn each, tree (over DROP x ring)
    leaves; mpi at 2.5 s leaves too and the class settles on ring at once, at 1.8 s it
    takes the trial's other turns (beyond RUNOFF: no runoff). Exact results throughout."""
    monkeypatch.setattr(select, "estimates", _estimates({"ring": 1.0, "mpi": 1.1, "tree": 1.2}))
    _fake_time(monkeypatch, {"ring": 1.0, "mpi": mpi_s, "tree": 3.0}.get)
    n = comm.Get_size()
    x = np.full(_tried(trials), comm.Get_rank() + 1.0)
    c = select.size_class(x.nbytes)
    before = _runs("ring", "mpi", "tree", trial=True)
    first = online.BURST * 3
    stays = mpi_s <= online.DROP
    total = first + (online.ROUNDS - 1) * online.BURST * 2 if stays else first
    for i in range(total):
        assert c not in state.of(trials).settled, i
        assert_equal(C.allreduce(x, op=C.Sum), np.full(x.size, n * (n + 1) / 2.0), f"call {i}")
    assert state.of(trials).settled == {c: "ring"} and not state.of(trials).trials
    ran = _runs("ring", "mpi", "tree", trial=True)
    turns = online.ROUNDS * online.BURST if stays else online.BURST
    assert {a: ran[a] - before[a] for a in ran} == {"ring": turns, "mpi": turns,
                                                   "tree": online.BURST}
    # what the trial cost (each call once) sets how long the class runs before a retry
    spent = online.BURST * (3.0 + (online.ROUNDS * (1.0 + mpi_s) if stays else 1.0 + mpi_s))
    window = online.MIN_WATCH  # 1 s calls
    assert abs(state.of(trials).watches[c].reviews_left - spent / online.RETRY_SHARE / window) < 1.5


@pytest.mark.mpi(min_size=2)
def test_online_trial_with_one_close_candidate_settles_at_once(comm, trials, monkeypatch):
    monkeypatch.setattr(select, "estimates", _estimates({"ring": 1.0}))
    x = np.ones(_tried(trials))
    C.allreduce(x, op=C.Sum)
    assert state.of(trials).settled == {select.size_class(x.nbytes): None} and not state.of(trials).trials


@pytest.mark.mpi(min_size=2)
def test_online_trials_under_per_rank_noise_and_a_joined_rank(comm, trials, monkeypatch):
    """Real timings with per-rank noise, three classes tried at once, rank 0 joining before
    the trials end (calls while it has joined run `auto`'s estimate on every rank and
    count for no trial), then every rank calling again, through any runoffs: no hang, exact
    results, and every rank settles every class alike."""
    monkeypatch.setattr(select, "estimates", _estimates({"ring": 1.0, "mpi": 1.2, "tree": 1.9}))
    clock = time.perf_counter
    noise = iter(range(10 ** 6))
    late = [0.0]

    def noisy() -> float:  # a clock that runs late by 0-4 ms a read (x rank + 1)
        late[0] += (comm.rank + 1) * 1e-3 * (next(noise) % 5)
        return clock() + late[0]

    monkeypatch.setattr(online, "clock", noisy)
    monkeypatch.setattr(online, "WATCH_S", 1e3)  # no review: this noise drifts at will
    monkeypatch.setattr(online, "DROP", math.inf)  # every trial runs its ROUNDS
    n, r = comm.Get_size(), comm.Get_rank()
    base = _tried(trials)
    sizes = [base, 4 * base + 3, 16 * base + 5]
    trial = online.ROUNDS * online.BURST * 3  # calls of a class's trial: 3 candidates
    first = trial // 3
    steps = first if r == 0 else 2 * first

    def calls(steps: range, active: int) -> None:
        for step in steps:
            for count in sizes:
                got = C.allreduce(np.full(count, float(r + step)), op=C.Sum)
                want = active * step + n * (n - 1) // 2  # rank 0 adds r = 0 when active
                assert_equal(got, np.full(count, float(want)), f"{step} {count} {active}")

    calls(range(first), n)
    calls(range(first, steps), n - 1)
    assert C.join() == n - 1
    assert not state.of(trials).settled  # `first` counted calls each: no trial has ended
    calls(range(trial - first), n)
    runoff = online.RUNOFF_TURNS * online.BURST * 2  # for classes whose finalists are close
    for step in range(trial, trial + runoff):
        if not state.of(trials).trials:  # alike on every rank
            break
        calls(range(step, step + 1), n)
    settled = {c: a for c, a in state.of(trials).settled.items()}
    assert len(settled) == len(sizes) and not state.of(trials).trials
    assert len({tuple(sorted(s.items(), key=str)) for s in comm.allgather(settled)}) == 1


@pytest.mark.mpi(min_size=2)
def test_online_trial_under_async_calls_of_many_shapes(comm, trials, monkeypatch):
    """Async calls of 60 shapes of one class queued at once (a trial of 3 candidates and a
    runoff take 50): the caller's thread describes new shapes while the engine's thread
    runs the trial and settles the class. Every call
    runs the same algorithm on every rank (no hang), every result is exact, and the class
    settles alike everywhere."""
    monkeypatch.setattr(select, "estimates", _estimates({"ring": 1.0, "mpi": 1.2, "tree": 1.9}))
    n, r = comm.Get_size(), comm.Get_rank()
    base = _tried(trials)
    counts = [base + 8 * i for i in range(60)]
    assert len({select.size_class(8 * c) for c in counts}) == 1
    handles = [C.allreduce_async(np.full(c, float(r + i)), op=C.Sum) for i, c in enumerate(counts)]
    for i, (c, h) in enumerate(zip(counts, handles)):
        assert_equal(C.synchronize(h), np.full(c, float(n * i + n * (n - 1) // 2)), f"call {i}")
    assert len(state.of(trials).settled) == 1 and not state.of(trials).trials
    assert len({tuple(s.items()) for s in comm.allgather(dict(state.of(trials).settled))}) == 1


# ------------------------------------------ autotune.Memory: settled classes for later jobs

def _memory(comm, tmp_path_factory, settled: dict | None = None) -> autotune.Memory:
    """A Memory over a cache file of this job's key (on rank 0's disk, the path the same on
    every rank), holding settled as a later job would read it."""
    k = autotune.key(topology.get())
    path = comm.bcast(str(tmp_path_factory.mktemp("memory") / "tuning.json")
                      if comm.rank == 0 else None)
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump({"key": k, "measured": {}, "settled": settled or {}}, f)
    comm.Barrier()
    return autotune.Memory(Path(path), k, settled or {}, comm.rank)


@pytest.mark.mpi(min_size=2)
def test_a_later_job_starts_from_the_classes_an_earlier_one_settled(comm, trials, monkeypatch,
                                                                  tmp_path_factory):
    """Job 1 settles a class on ring by a trial and keeps it in the cache file; job 2 (a
    fresh table, the file's entries) settles that class at its first call, runs no trial
    call, and watches it as job 1 did; a class the file lacks is tried as before."""
    seconds: dict[str, float] = {}
    _fake_time(monkeypatch, lambda a: seconds[a])
    state.of(trials).memory = _memory(comm, tmp_path_factory)
    x = _settle_ring_over_mpi(comm, trials, monkeypatch, seconds)
    c = select.size_class(x.nbytes)
    window = state.of(trials).watches[c].window
    kept = comm.bcast(json.loads(state.of(trials).memory.path.read_text())["settled"]
                      if comm.rank == 0 else None)
    assert list(kept) == [str(c)] and kept[str(c)]["algorithm"] == "ring"
    assert kept[str(c)]["seconds_per_byte"] == pytest.approx(1.0 / x.nbytes)
    assert kept[str(c)]["spent"] == pytest.approx(online.ROUNDS * online.BURST * (1.0 + 2.0))

    monkeypatch.setattr(state.of(trials), "settled", {})  # job 2
    monkeypatch.setattr(state.of(trials), "watches", {})
    auto = state.of(trials)
    auto.memory = autotune.Memory(auto.memory.path, auto.memory.key, kept, comm.rank)
    tried = _runs("ring", "mpi", trial=True)
    _calls(comm, x, 3)
    assert state.of(trials).settled == {c: "ring"} and state.of(trials).watches[c].window == window
    assert _runs("ring", "mpi", trial=True) == tried
    other = np.full(x.size * 4, comm.Get_rank() + 1.0)  # the next class: not in the file
    C.allreduce(other, op=C.Sum)
    assert select.size_class(other.nbytes) in state.of(trials).trials
    C.allreduce_(x.copy(), op=C.Sum)  # the same size in place: another class, not in it
    assert select.size_class(x.nbytes, inplace=True) in state.of(trials).trials


@pytest.mark.mpi(min_size=2)
def test_in_place_and_out_of_place_settle_apart(comm, trials, monkeypatch):
    """Out of place settles on ring (ring 1 s, mpi 2 s a call); then, with the times the
    other way round, the same size in place is a class of its own: it is tried and settles
    on mpi, while out-of-place calls still run ring; both exact. With rank 0 joined, the
    others' in-place calls run mpi on every rank (the joined rank reads in_place from the
    call's agreed fields). A rank calling in place where the others do not is a mismatch on
    every rank, naming in_place."""
    seconds: dict[str, float] = {}
    _fake_time(monkeypatch, lambda a: seconds[a])
    x = _settle_ring_over_mpi(comm, trials, monkeypatch, seconds)
    n, out, inside = comm.Get_size(), select.size_class(x.nbytes), \
        select.size_class(x.nbytes, inplace=True)
    assert inside != out and inside not in state.of(trials).settled
    seconds.update(ring=2.0, mpi=1.0)
    for i in range((online.ROUNDS + online.RUNOFF_TURNS) * online.BURST * 2):
        y = x.copy()
        C.allreduce_(y, op=C.Sum)
        assert_equal(y, np.full(x.size, n * (n + 1) / 2.0), f"in place, call {i}")
        if inside in state.of(trials).settled:
            break
    assert state.of(trials).settled == {out: "ring", inside: "mpi"}
    assert select.choose("allreduce", x.nbytes, trials) == "ring"
    assert select.choose("allreduce", x.nbytes, trials, inplace=True) == "mpi"
    ran = _runs("ring", "mpi", trial=False)
    assert_equal(C.allreduce(x, op=C.Sum), np.full(x.size, n * (n + 1) / 2.0), "out of place")
    y = x.copy()
    C.allreduce_(y, op=C.Sum)
    assert_equal(y, np.full(x.size, n * (n + 1) / 2.0), "in place")
    assert _runs("ring", "mpi", trial=False) == {"ring": ran["ring"] + 1, "mpi": ran["mpi"] + 1}

    ran = _runs("ring", "mpi", trial=False)
    if comm.rank == 0:
        C.join()
    else:
        y = x.copy()
        C.allreduce_(y, op=C.Sum)
        assert_equal(y, np.full(x.size, n * (n + 1) / 2.0 - 1), "in place, rank 0 joined")
        C.join()
        assert _runs("ring", "mpi", trial=False)["mpi"] == ran["mpi"] + 1  # joined: uncounted

    with pytest.raises(C.MismatchError, match="in_place"):
        if comm.rank == 0:
            C.allreduce_(x.copy(), op=C.Sum)
        else:
            C.allreduce(x, op=C.Sum)


@pytest.mark.mpi(min_size=2)
def test_a_remembered_class_is_tried_again_when_it_drifts(comm, trials, monkeypatch,
                                                          tmp_path_factory):
    """A class settled from the cache on ring; ring then slows 4x: its watch tries the
    class again (not the cache's word again), every rank settles on mpi, and the file now
    keeps mpi."""
    seconds = {"ring": 1.0, "mpi": 2.0}
    _fake_time(monkeypatch, lambda a: seconds[a])
    monkeypatch.setattr(select, "estimates", _estimates({"ring": 1.0, "mpi": 1.5}))
    x = np.full(_tried(trials), comm.Get_rank() + 1.0)
    c = select.size_class(x.nbytes)
    entry = {"algorithm": "ring", "seconds_per_byte": 1.0 / x.nbytes, "spent": 18.0}
    state.of(trials).memory = _memory(comm, tmp_path_factory, {str(c): entry})
    tried = _runs("ring", "mpi", trial=True)
    _calls(comm, x, online.MIN_WATCH + 1)  # settled from the cache; reviewed, renewed
    assert state.of(trials).settled == {c: "ring"} and _runs("ring", "mpi", trial=True) == tried
    seconds["ring"] = 4.0
    _calls(comm, x, online.MIN_WATCH + online.ROUNDS * online.BURST * 2)
    assert state.of(trials).settled == {c: "mpi"}
    if comm.rank == 0:
        assert json.loads(state.of(trials).memory.path.read_text())["settled"][str(c)]["algorithm"] \
            == "mpi"


@pytest.mark.mpi(min_size=2)  # one rank measures nothing and keeps no cache
def test_a_cache_of_another_setup_gives_no_settled_class(comm, cache, monkeypatch):
    """A cache file at this setup's path whose key is another's (another host): install
    measures again and the job's communicator recalls nothing from it."""
    topo = topology.get()
    k = autotune.key(topo)
    path = autotune.cache_path(k)
    if comm.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        other = dict(k, hosts=["elsewhere"] * len(k["hosts"]))
        path.write_text(json.dumps({"key": other, "measured": {},
                                    "settled": {"5": {"algorithm": "ring",
                                                      "seconds_per_byte": 1e-9,
                                                      "spent": 1.0}}}))
    comm.Barrier()
    monkeypatch.setattr(state.of(topo), "memory", None)
    monkeypatch.setattr(topo, "config", config.Config())
    monkeypatch.setattr(autotune, "measure", lambda topo, timed: {})
    monkeypatch.setattr(costmodel, "_installed", costmodel._installed)  # restored after
    try:
        autotune.install(topo, timed_call)
        memory = state.of(topo).memory
        assert memory is not None and memory.recall(5) is None
        assert comm.bcast(json.loads(path.read_text())["key"] if comm.rank == 0 else None) == k
    finally:
        select.estimates_changed()


@pytest.mark.mpi(min_size=2)
def test_the_timeline_and_stats_name_the_trial_calls(comm, trials, monkeypatch, tmp_path_factory):
    """A class tried between ring and mpi: the timeline shows each trial call's algorithm as
    "<algorithm> (trial)" and the settled calls' as the one that ran; the stats count the
    trial calls apart."""
    seconds: dict[str, float] = {}
    _fake_time(monkeypatch, lambda a: seconds[a])
    path = comm.bcast(str(tmp_path_factory.mktemp("trace") / "t.json")
                      if comm.rank == 0 else None)
    tried = _runs("ring", "mpi", trial=True)
    C.start_timeline(path)
    x = _settle_ring_over_mpi(comm, trials, monkeypatch, seconds)
    C.allreduce(x, op=C.Sum)
    C.stop_timeline()
    turns = online.ROUNDS * online.BURST
    assert _runs("ring", "mpi", trial=True) == {a: tried[a] + turns for a in tried}
    comm.Barrier()
    if comm.rank == 0:
        events = json.loads(Path(path).read_text())["traceEvents"]
        ran = [e["args"]["algorithm"] for e in events if e["pid"] == 0 and e["ph"] == "X"
               and e["tid"] == 0 and e.get("args", {}).get("collective") == "allreduce"]
        assert sorted(ran[:-1]) == ["mpi (trial)"] * turns + ["ring (trial)"] * turns, ran
        assert ran[-1] == "ring"
