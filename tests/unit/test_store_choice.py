"""How a shared-memory window chooses between plain and streaming stores into its staging
buffers (StoreChoice in csrc/runtime/shm.h): which way each call of a kind runs, given the
times of the calls before it. Times here are seconds per byte, the calls 1 byte."""

from __future__ import annotations

import pytest

from collectives.kernels import _C

KIND = _C.StoreChoice.key(64 << 20, True, False, False)
CHUNKS = 8  # the fewest chunks whose stores are chosen
PLAIN, STREAMING = False, True


def calls(choice, costs: dict[bool, list[float]] | dict[bool, float], n: int,
          kind: int = KIND) -> list[bool]:
    """Make n calls of kind, each way taking its cost (a list: successive calls' costs of
    that way); the ways they ran."""
    ways, made = [], {PLAIN: 0, STREAMING: 0}
    for _ in range(n):
        way = choice.pick(kind, CHUNKS)
        cost = costs[way]
        if isinstance(cost, list):
            cost = cost[min(made[way], len(cost) - 1)]
        made[way] += 1
        choice.record(kind, way, cost, 1)
        ways.append(way)
    return ways


def test_small_calls_use_plain_stores_uncounted():
    choice = _C.StoreChoice()
    assert not any(choice.pick(KIND, CHUNKS - 1) for _ in range(10))
    assert calls(choice, {PLAIN: 1.0, STREAMING: 0.5}, 5)[3:] == [STREAMING, STREAMING]


def test_first_trial_runs_the_other_way_twice_and_keeps_the_faster():
    faster = calls(_C.StoreChoice(), {PLAIN: 1.0, STREAMING: 0.5}, 8)
    assert faster == [PLAIN] * 3 + [STREAMING] * 5
    slower = calls(_C.StoreChoice(), {PLAIN: 0.5, STREAMING: 1.0}, 8)
    assert slower == [PLAIN] * 3 + [STREAMING] * 2 + [PLAIN] * 3


def test_one_cold_call_decides_nothing():
    """A trial's first call after the other way's (its caches cold, its pages fresh) takes
    several times its steady time; so does a running way's odd call. The best of each way's
    last two calls is compared, so neither sends the kind to the slower way."""
    cold_trial = calls(_C.StoreChoice(), {PLAIN: 1.0, STREAMING: [4.0, 0.5]}, 8)
    assert cold_trial[5:] == [STREAMING] * 3
    cold_running = calls(_C.StoreChoice(), {PLAIN: [1.0, 1.0, 4.0, 1.0], STREAMING: 2.0}, 8)
    assert cold_running[5:] == [PLAIN] * 3


def test_losing_trials_come_further_apart():
    """A trial the other way loses costs what the ways differ by: the gap between trials
    doubles after each loss, up to 256 calls (16 after a trial the other way won)."""
    ways = calls(_C.StoreChoice(), {PLAIN: 0.5, STREAMING: 1.0}, 2000)
    starts = [k + 1 for k in range(len(ways)) if ways[k] and (k == 0 or not ways[k - 1])]
    assert starts[:4] == [4, 36, 100, 228]
    assert {b - a for a, b in zip(starts[3:], starts[4:])} == {256}
    assert ways.count(STREAMING) == 2 * len(starts)


def test_a_machine_that_changed_is_tried_at_once():
    """The running way's cost moving by over 1.5x from the last trial's (two calls in a row:
    one is noise) brings the next trial forward."""
    choice = _C.StoreChoice()
    assert calls(choice, {PLAIN: 0.5, STREAMING: 1.0}, 60)[-1] == PLAIN  # gap now 64
    assert calls(choice, {PLAIN: [2.0], STREAMING: 1.0}, 5) == [PLAIN] * 2 + [STREAMING] * 3
    assert calls(choice, {PLAIN: 0.5, STREAMING: 3.0}, 3) == [STREAMING] * 2 + [PLAIN]


@pytest.mark.parametrize("first", [PLAIN, STREAMING])
def test_a_new_kind_starts_on_the_way_the_latest_trial_chose(first):
    """Which way is faster follows the machine, so a kind met for the first time runs the
    latest trial's choice until its own trial."""
    choice = _C.StoreChoice()
    costs = {first: 0.5, not first: 1.0}
    calls(choice, costs, 8)
    other = _C.StoreChoice.key(256 << 20, True, True, True)
    assert calls(choice, costs, 3, other) == [first] * 3


def test_kinds_are_sizes_within_a_power_of_two_and_the_call_shape():
    key = _C.StoreChoice.key
    assert key(64 << 20, True, False, False) == key((128 << 20) - 1, True, False, False)
    shapes = {key(1 << 26, a, i, v) for a in (False, True) for i in (False, True)
              for v in (False, True)}
    assert len(shapes) == 8 and key(1 << 27, True, False, False) not in shapes
    with pytest.raises(ValueError, match="key"):
        _C.StoreChoice().record(KIND, False, 1.0, 1)


def test_counts_say_how_each_kind_ran():
    choice = _C.StoreChoice()
    calls(choice, {PLAIN: 1.0, STREAMING: 0.5}, 8)
    assert choice.counts() == {(64 << 20, True, False, False): (3, 5, 1)}
