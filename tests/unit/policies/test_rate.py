"""SlidingWindow: check-and-take, expiry, refunds, wait times, and the any-window bound as a property."""

import copy
import random

import pytest

from tokenweir.policies.rate import SlidingWindow

T0 = 1_700_000_000.0  # a slot boundary (divisible by 1s)


def test_takes_until_limit_then_refuses():
    w = SlidingWindow(limit=3)
    assert [w.take(1, T0 + i * 0.1) for i in range(4)] == [True, True, True, False]
    assert w.used(T0 + 0.5) == 3
    assert w.remaining(T0 + 0.5) == 0


def test_take_is_all_or_nothing():
    w = SlidingWindow(limit=10)
    assert w.take(7, T0)
    assert not w.take(4, T0)
    assert w.used(T0) == 7
    assert w.take(3, T0)


def test_units_expire_after_window_plus_one_slot():
    w = SlidingWindow(limit=1, window_s=60, slots=60)
    assert w.take(1, T0 + 0.5)  # slot T0/1s
    assert not w.fits(1, T0 + 60.5)  # still counted: slot k is counted through slot k + 60
    assert w.fits(1, T0 + 61.0)


def test_wait_s_is_exactly_when_units_fit():
    w = SlidingWindow(limit=5)
    w.add(2, T0 + 0.2)
    w.add(3, T0 + 10.7)
    now = T0 + 30.0
    assert w.wait_s(0, now) == 0.0
    wait = w.wait_s(2, now)  # must drop the first slot (2 units): free at T0 + 61
    assert wait == pytest.approx(31.0)
    assert not w.fits(2, now + wait - 1e-6)
    assert w.fits(2, now + wait)
    assert w.wait_s(4, now) == pytest.approx(T0 + 71.0 - now)


def test_more_than_limit_never_fits():
    w = SlidingWindow(limit=5)
    assert w.wait_s(6, T0) is None
    assert not w.take(6, T0)
    assert w.used(T0) == 0


def test_zero_limit_admits_nothing():
    w = SlidingWindow(limit=0)
    assert not w.take(1, T0)
    assert w.take(0, T0)


def test_refund_returns_units_to_their_slot():
    w = SlidingWindow(limit=100)
    w.add(60, T0 + 1.2)
    w.add(30, T0 + 5.0)
    assert w.refund(50, T0 + 1.9, T0 + 20) == 50  # same slot as the take
    assert w.used(T0 + 20) == 40
    assert w.refund(50, T0 + 1.0, T0 + 20) == 10  # never more than the slot holds
    assert w.used(T0 + 20) == 30


def test_refund_after_expiry_is_a_no_op():
    w = SlidingWindow(limit=100)
    w.add(60, T0)
    assert w.refund(60, T0, T0 + 120) == 0
    assert w.used(T0 + 120) == 0


def test_add_counts_past_the_limit():
    w = SlidingWindow(limit=10)
    w.add(25, T0)  # an overshoot settled after the fact is recorded, not lost
    assert w.used(T0) == 25
    assert w.remaining(T0) == 0
    assert w.wait_s(1, T0) == pytest.approx(61.0)


def test_clock_stepping_back_still_counts():
    w = SlidingWindow(limit=10)
    w.add(4, T0 + 10)
    w.add(3, T0 + 5)  # wall clock stepped back: counted in the newest slot, not dropped
    assert w.used(T0 + 10) == 7


def test_reset_s_until_empty():
    w = SlidingWindow(limit=10)
    assert w.reset_s(T0) == 0.0
    w.add(1, T0 + 0.5)
    w.add(1, T0 + 20.5)
    assert w.reset_s(T0 + 30) == pytest.approx(T0 + 81 - (T0 + 30))


@pytest.mark.parametrize("seed", range(20))
def test_property_never_more_than_limit_in_any_window(seed):
    rng = random.Random(seed)
    limit = rng.randint(1, 30)
    window, slots = rng.choice([(60.0, 60), (60.0, 7), (10.0, 10), (1.0, 4)])
    w = SlidingWindow(limit=limit, window_s=window, slots=slots)
    admitted = []  # (time, units)
    t = T0 + rng.random()
    for _ in range(400):
        t += rng.expovariate(limit / window * 3)  # offered at ~3x the limit
        n = rng.randint(1, max(1, limit // 3))
        if w.take(n, t):
            admitted.append((t, n))
    assert admitted, "nothing admitted: the test would prove nothing"
    # every window [s, s + window] that holds an admission starts at some admission time at worst
    for i, (start, _) in enumerate(admitted):
        in_window = sum(n for (at, n) in admitted[i:] if at <= start + window)
        assert in_window <= limit, (start, in_window, limit)


@pytest.mark.parametrize("seed", range(10))
def test_property_wait_s_is_sufficient(seed):
    rng = random.Random(seed)
    w = SlidingWindow(limit=50, window_s=60, slots=12)
    t = T0
    for _ in range(200):
        t += rng.random() * 3
        n = rng.randint(1, 20)
        wait = w.wait_s(n, t)
        assert wait is not None
        if wait > 0:
            assert not w.fits(n, t)
        later = copy.deepcopy(w)  # probing the future expires slots, so probe a copy
        assert later.fits(n, t + wait)
        assert wait == 0 or not copy.deepcopy(w).fits(n, t + wait - 1e-6)  # and not any earlier
        w.take(n, t)
