"""The balancer's shares as pure functions of speeds: whole samples summing to the global
batch, at least one a rank, proportional to speed, the same bits on every call; a change
adopted only past the threshold."""

from __future__ import annotations

import pytest
from collectives.optim.balance import better, equal_shares, proportional_shares


@pytest.mark.parametrize("total,speeds,expected", [
    (48, [1.0, 1.0], [24, 24]),
    (48, [3.0, 1.0], [36, 12]),
    (49, [1.0, 1.0], [25, 24]),  # the spare sample to the lower rank
    (10, [1000.0, 1.0, 1.0], [8, 1, 1]),  # at least one each
    (3, [5.0, 1.0, 1.0], [1, 1, 1]),
    (100, [2.0, 1.0, 1.0, 0.5], [44, 22, 22, 12]),  # remainders .67, .33, .33, .67
])
def test_proportional_shares(total, speeds, expected):
    shares = proportional_shares(total, speeds)
    assert shares == expected and sum(shares) == total
    assert proportional_shares(total, list(speeds)) == shares


def test_equal_shares_follow_horovods_rule():
    assert equal_shares(10, 4) == [3, 3, 2, 2]


def test_bad_totals_and_speeds_raise():
    with pytest.raises(ValueError, match="total"):
        proportional_shares(2, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="speeds"):
        proportional_shares(10, [1.0, 0.0])
    with pytest.raises(ValueError, match="speeds"):
        proportional_shares(10, [1.0, float("nan")])


def test_a_change_is_adopted_only_past_the_threshold():
    speeds = [1.0, 1.0]
    assert not better([24, 24], [25, 23], speeds, 0.05)  # slower, not faster
    assert better([30, 18], [24, 24], speeds, 0.05)  # 30 -> 24 samples' time: 20% shorter
    assert not better([25, 23], [24, 24], speeds, 0.05)  # 4% shorter: under the threshold
    assert better([25, 23], [24, 24], speeds, 0.03)
