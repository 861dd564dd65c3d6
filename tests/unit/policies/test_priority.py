"""Priority bands and the stride scheduler: weighted shares, no banked credit, stable ties."""

from collections import Counter

import pytest

from tokenweir.policies.limits import PRIORITY_BATCH, PRIORITY_CRITICAL, PRIORITY_STANDARD
from tokenweir.policies.priority import BIG, StrideScheduler, band_of, pick_displaced, stride_of


def test_band_of_clamps_and_defaults():
    assert band_of(None, PRIORITY_STANDARD) == PRIORITY_STANDARD
    assert band_of(-5, PRIORITY_STANDARD) == PRIORITY_CRITICAL
    assert band_of(99, PRIORITY_STANDARD) == PRIORITY_BATCH
    assert band_of(2, PRIORITY_CRITICAL) == PRIORITY_BATCH


def test_stride_is_inverse_weight():
    assert stride_of(1) == BIG
    assert stride_of(4) == BIG // 4
    with pytest.raises(AssertionError):
        stride_of(0)


def run(s: StrideScheduler, n: int) -> list[str]:
    out = []
    for _ in range(n):
        team = s.peek()
        out.append(team)
        s.served(team)
    return out


@pytest.mark.parametrize("weights", [(1, 3), (2, 5), (1, 1, 1), (7, 1, 2)])
def test_shares_follow_weights_exactly(weights):
    s = StrideScheduler()
    teams = [f"t{i}" for i in range(len(weights))]
    for team, w in zip(teams, weights, strict=True):
        s.activate(team, w)
    rounds = 20 * sum(weights)
    counts = Counter(run(s, rounds))
    for team, w in zip(teams, weights, strict=True):
        assert abs(counts[team] - rounds * w / sum(weights)) <= 1


def test_ties_go_to_the_earlier_activation():
    s = StrideScheduler()
    s.activate("b", 1)
    s.activate("a", 1)
    assert run(s, 4) == ["b", "a", "b", "a"]


def test_newcomer_cannot_bank_credit():
    s = StrideScheduler()
    s.activate("old", 1)
    run(s, 100)
    s.activate("new", 1)  # starts at the band's min pass, not at 0
    order = run(s, 10)
    assert Counter(order) == {"old": 5, "new": 5}


def test_leaving_and_rejoining_keeps_debt():
    s = StrideScheduler()
    s.activate("a", 1)
    s.activate("b", 1)
    run(s, 2)
    s.deactivate("a")
    run(s, 1)  # b alone
    a_pass = s.pass_of("a")
    s.activate("a", 1)
    assert s.pass_of("a") >= a_pass


def test_rejoin_after_long_idle_starts_at_the_floor():
    s = StrideScheduler()
    s.activate("a", 1)
    s.activate("b", 1)
    run(s, 2)
    s.deactivate("a")
    run(s, 50)
    s.activate("a", 1)
    assert Counter(run(s, 10)) == {"a": 5, "b": 5}


def test_empty_band_floor_is_the_last_dispatch():
    s = StrideScheduler()
    s.activate("a", 1)
    run(s, 30)
    s.deactivate("a")
    s.activate("b", 1)
    assert s.pass_of("b") == 29 * BIG
    assert s.peek() == "b"


def test_served_while_inactive_is_a_bug():
    s = StrideScheduler()
    with pytest.raises(AssertionError):
        s.served("ghost")


def test_a_higher_band_displaces_the_latest_arrival_of_the_lowest_band_below_it():
    waiters = [(1, 1, "std-early"), (2, 2, "batch-early"), (2, 5, "batch-late"), (1, 7, "std-late"), (0, 9, "crit")]
    assert pick_displaced(PRIORITY_CRITICAL, waiters) == "batch-late"
    assert pick_displaced(PRIORITY_STANDARD, waiters) == "batch-late"


def test_only_bands_strictly_below_the_newcomer_can_be_displaced():
    waiters = [(1, 1, "std-early"), (1, 4, "std-late"), (0, 9, "crit")]
    assert pick_displaced(PRIORITY_CRITICAL, waiters) == "std-late"
    assert pick_displaced(PRIORITY_STANDARD, waiters) is None, "the same band never displaces: arrival order holds"
    assert pick_displaced(PRIORITY_BATCH, waiters) is None
    assert pick_displaced(PRIORITY_CRITICAL, [(0, 1, "crit")]) is None
    assert pick_displaced(PRIORITY_CRITICAL, []) is None


def test_displacement_does_not_depend_on_the_order_waiters_are_listed_in():
    waiters = [(2, arrival, f"b{arrival}") for arrival in (3, 11, 7)] + [(1, 20, "s20")]
    for order in (waiters, waiters[::-1], sorted(waiters, key=lambda w: w[2])):
        assert pick_displaced(PRIORITY_CRITICAL, order) == "b11"
