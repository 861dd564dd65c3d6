"""Budgets: UTC period keys and resets (midnight, month end, leap day), reserve / settle arithmetic, rollover."""

import random
from datetime import UTC, datetime

import pytest

from tokenweir.policies.budget import (
    DAY,
    MONTH,
    Budget,
    day_key,
    month_key,
    period_bounds,
    period_key,
    period_start_day,
    seconds_until_reset,
    settle_amounts,
)


def ts(*args) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("moment", "day", "month"),
    [
        ((2024, 2, 29, 23, 59, 59, 999_000), "2024-02-29", "2024-02"),
        ((2024, 3, 1, 0, 0, 0), "2024-03-01", "2024-03"),
        ((2025, 12, 31, 23, 59, 59), "2025-12-31", "2025-12"),
        ((2026, 1, 1, 0, 0, 0), "2026-01-01", "2026-01"),
    ],
)
def test_period_keys_are_utc(moment, day, month):
    now = ts(*moment)
    assert day_key(now) == period_key(DAY, now) == day
    assert month_key(now) == period_key(MONTH, now) == month


def test_period_start_day_matches_store_since_day():
    now = ts(2026, 11, 22, 4, 30)
    assert period_start_day(DAY, now) == "2026-11-22"
    assert period_start_day(MONTH, now) == "2026-11-01"


def test_seconds_until_reset():
    assert seconds_until_reset(DAY, ts(2026, 3, 5, 0, 0, 0)) == 86400
    assert seconds_until_reset(DAY, ts(2026, 3, 5, 23, 59, 59)) == 1
    assert seconds_until_reset(MONTH, ts(2024, 2, 1)) == 29 * 86400  # leap February
    assert seconds_until_reset(MONTH, ts(2025, 2, 28, 23, 0)) == 3600
    assert seconds_until_reset(MONTH, ts(2025, 12, 31, 12, 0)) == 12 * 3600  # year end


@pytest.mark.parametrize(
    ("reserved", "actual", "refund", "overshoot"),
    [(100, 40, 60, 0), (100, 100, 0, 0), (100, 130, 0, 30), (0, 5, 0, 5), (5, 0, 5, 0)],
)
def test_settle_amounts(reserved, actual, refund, overshoot):
    assert settle_amounts(reserved, actual) == (refund, overshoot)


NOW = ts(2026, 5, 10, 12, 0)


def test_reserve_then_settle_refunds_the_unused_part():
    b = Budget(DAY, limit=1000)
    key = b.reserve(600, NOW)
    assert b.remaining(NOW) == 400
    assert not b.fits(401, NOW)
    b.settle(key, 600, 250, NOW + 5)
    assert (b.spent, b.reserved, b.remaining(NOW + 5)) == (250, 0, 750)


def test_overshoot_is_charged_not_lost():
    b = Budget(DAY, limit=1000)
    key = b.reserve(100, NOW)
    assert b.settle(key, 100, 180, NOW) == 80
    assert (b.spent, b.reserved, b.overshoot) == (180, 0, 80)


def test_overshoot_past_the_limit_reads_as_zero_remaining():
    b = Budget(DAY, limit=100)
    key = b.reserve(100, NOW)
    b.settle(key, 100, 150, NOW)
    assert b.spent == 150
    assert b.remaining(NOW) == 0
    assert not b.fits(1, NOW)
    assert b.fits(0, NOW)


def test_unlimited_budget_still_tracks_spend():
    b = Budget(MONTH, limit=None)
    key = b.reserve(10**9, NOW)
    assert b.remaining(NOW) is None
    b.settle(key, 10**9, 7, NOW)
    assert b.spent == 7


def test_day_rolls_over_at_utc_midnight():
    b = Budget(DAY, limit=100)
    before = ts(2026, 5, 10, 23, 59, 59)
    key = b.reserve(100, before)
    assert not b.fits(1, before)
    after = ts(2026, 5, 11, 0, 0, 0)
    assert b.remaining(after) == 100  # a fresh day
    # the hold from yesterday is gone with yesterday; its actual tokens land on today, as usage rows do
    b.settle(key, 100, 30, after)
    assert (b.key, b.spent, b.reserved) == ("2026-05-11", 30, 0)


def test_month_rolls_over_at_month_end_not_before():
    b = Budget(MONTH, limit=100)
    b.reserve(100, ts(2024, 2, 29, 23, 0))
    assert b.remaining(ts(2024, 2, 29, 23, 59, 59)) == 0
    assert b.remaining(ts(2024, 3, 1, 0, 0, 0)) == 100


def test_seed_sets_spend_for_the_current_period():
    b = Budget(DAY, limit=1000)
    b.seed(900, NOW)
    assert b.remaining(NOW) == 100
    assert not b.fits(101, NOW)


@pytest.mark.parametrize("seed", range(25))
def test_property_spent_plus_reserved_within_limit_at_admission(seed):
    rng = random.Random(seed)
    limit = rng.randint(50, 5000)
    b = Budget(DAY, limit=limit)
    holds = []
    now = NOW
    total_actual = 0
    for _ in range(300):
        now += rng.random()
        if holds and rng.random() < 0.45:
            key, n = holds.pop(rng.randrange(len(holds)))
            actual = rng.randint(0, n)  # engines never exceed max_tokens
            b.settle(key, n, actual, now)
            total_actual += actual
        else:
            n = rng.randint(1, limit // 4 + 1)
            if b.fits(n, now):
                holds.append((b.reserve(n, now), n))
                assert b.spent + b.reserved <= limit
        assert b.reserved == sum(n for _, n in holds)
        assert b.spent == total_actual
        assert b.spent + b.reserved <= limit


def test_period_bounds():
    assert period_bounds(DAY, ts(2026, 3, 5, 13, 0)) == (ts(2026, 3, 5), ts(2026, 3, 6))
    assert period_bounds(MONTH, ts(2024, 2, 29, 23, 59)) == (ts(2024, 2, 1), ts(2024, 3, 1))
    assert period_bounds(MONTH, ts(2025, 12, 31, 1)) == (ts(2025, 12, 1), ts(2026, 1, 1))


def test_clock_stepping_back_over_midnight_does_not_reset_the_new_day():
    b = Budget(DAY, limit=100)
    after = ts(2026, 5, 11, 0, 0, 1)
    b.reserve(100, after)
    assert not b.fits(1, after - 2)  # 23:59:59 of the day before: still today's period, still full
    assert b.key == "2026-05-11"
