"""Token budgets per UTC day and UTC month: period keys, and reserve / settle arithmetic.

A request reserves prompt + max_tokens before dispatch and settles to the actual count after. Admission
checks spent + reserved + n <= limit, so concurrent in-flight requests can never jointly overrun the budget by
more than what an engine produces past its max_tokens (which it must not). Settling refunds reserved - actual
(never below zero); an actual above the reservation is charged in full and tallied as overshoot, never lost.
"""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from tokenweir.policies.decisions import Rejected
from tokenweir.policies.retry import retry_after

DAY = "day"
MONTH = "month"


def _utc(now: float) -> datetime:
    return datetime.fromtimestamp(now, tz=UTC)


# The last day's [start, end) and key: strftime once a day, not on every request that files usage.
_last_day: tuple[float, float, str] = (0.0, 0.0, "")


def day_key(now: float) -> str:
    """'YYYY-MM-DD' in UTC: the same key as the store's usage rows."""
    global _last_day
    start, end, key = _last_day
    if start <= now < end:
        return key
    key = _utc(now).strftime("%Y-%m-%d")
    start, end = period_bounds(DAY, now)
    _last_day = (start, end, key)
    return key


def month_key(now: float) -> str:
    return _utc(now).strftime("%Y-%m")


def period_key(period: str, now: float) -> str:
    assert period in (DAY, MONTH), period
    return day_key(now) if period == DAY else month_key(now)


def period_start_day(period: str, now: float) -> str:
    """First day ('YYYY-MM-DD') of the period at `now`, as `Store.spent_tokens(team, since_day)` wants."""
    t = _utc(now)
    return t.strftime("%Y-%m-%d") if period == DAY else t.strftime("%Y-%m-01")


def period_bounds(period: str, now: float) -> tuple[float, float]:
    """[start, end) of the UTC day or month holding `now`, as timestamps."""
    t = _utc(now)
    midnight = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == DAY:
        start = midnight
        end = midnight + timedelta(days=1)
    else:
        assert period == MONTH, period
        start = midnight.replace(day=1)
        end = start + timedelta(days=calendar.monthrange(t.year, t.month)[1])
    return start.timestamp(), end.timestamp()


def seconds_until_reset(period: str, now: float) -> float:
    """Seconds until the next UTC midnight (day) or the first of next month (month)."""
    return period_bounds(period, now)[1] - now


def settle_amounts(reserved: int, actual: int) -> tuple[int, int]:
    """(refund, overshoot): refund = reserved - actual floored at 0; overshoot = actual beyond reserved."""
    assert reserved >= 0 and actual >= 0
    return max(reserved - actual, 0), max(actual - reserved, 0)


@dataclass
class Budget:
    """One team's budget over one kind of period. limit None = unlimited (still tracked, for snapshots)."""

    period: str
    limit: int | None
    key: str = ""
    spent: int = 0
    reserved: int = 0
    overshoot: int = 0  # tokens charged beyond their reservations in this period
    _bounds: tuple[float, float] = (0.0, 0.0)  # [start, end) of `key`: rolling is a float compare, not strftime

    def roll(self, now: float) -> None:
        """Start a fresh period when `now` has crossed a UTC day / month boundary."""
        if self._bounds[0] <= now < self._bounds[1]:
            return
        if self.key and now < self._bounds[0]:
            return  # the wall clock stepped back over a boundary: periods only move forward
        key = period_key(self.period, now)
        self._bounds = period_bounds(self.period, now)
        if key != self.key:
            self.key, self.spent, self.reserved, self.overshoot = key, 0, 0, 0

    def remaining(self, now: float) -> int | None:
        self.roll(now)
        if self.limit is None:
            return None
        return max(0, self.limit - self.spent - self.reserved)

    def fits(self, n: int, now: float) -> bool:
        assert n >= 0
        remaining = self.remaining(now)
        return remaining is None or n <= remaining

    def reserve(self, n: int, now: float) -> str:
        """Hold n tokens in the current period; returns the period key the hold belongs to."""
        assert self.fits(n, now), "reserve without a passing fits()"
        self.reserved += n
        return self.key

    def settle(self, key: str, reserved: int, actual: int, now: float) -> int:
        """Turn a hold taken in period `key` into `actual` spend; returns the overshoot.

        If the period rolled over since the hold, the hold vanished with the old period and the actual tokens
        are charged to the current one, which is also where the usage recorder files them.
        """
        self.roll(now)
        _refund, overshoot = settle_amounts(reserved, actual)
        if key == self.key:
            self.reserved = max(0, self.reserved - reserved)
        self.spent += actual
        self.overshoot += overshoot
        return overshoot

    def seed(self, spent: int, now: float) -> None:
        """Spend already recorded in the store for the current period (at startup)."""
        assert spent >= 0
        self.roll(now)
        self.spent = spent


def spend_rejection(
    period: str,
    limit_micros: int,
    remaining_micros: int,
    needed_micros: int,
    reset_in_s: float,
    headers: dict[str, str],
    owner: str = "team",
) -> Rejected:
    """A daily or monthly spend (USD) budget said no; amounts in micro-USD (policies.pricing)."""
    wait = retry_after(reset_in_s)
    adj = {DAY: "daily", MONTH: "monthly"}[period]
    whose = "the team's" if owner == "team" else "this API key's"

    def usd(micros: int) -> str:
        return f"${micros / 1_000_000:.6f}".rstrip("0").rstrip(".")

    if needed_micros > limit_micros:
        msg = (
            f"Request too large for {whose} {adj} spend budget: it may cost up to {usd(needed_micros)} "
            f"(prompt + max_tokens at the model's prices), the whole budget is {usd(limit_micros)}. Lower max_tokens."
        )
    else:
        msg = (
            f"Spend budget exhausted: {whose} {adj} spend budget is {usd(limit_micros)}, {usd(remaining_micros)} left; "
            f"this request may cost up to {usd(needed_micros)} (prompt + max_tokens). "
            f"It resets at the start of the next UTC {period}, in {wait}s."
        )
    return Rejected("budget_exhausted", msg, wait, headers)


def as_key_rejection(rejected: Rejected) -> Rejected:
    """A refusal by the API key's own limits: the same decision, its message naming the key, not the team."""
    msg = rejected.message.replace("the team's", "this API key's")
    if msg == rejected.message:
        msg = f"{msg} (a limit of this API key)"
    return Rejected(rejected.reason, msg, rejected.retry_after_s, rejected.headers)
