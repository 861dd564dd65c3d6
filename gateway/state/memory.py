"""In-process live state: rate windows, budget reservations and concurrency slots per team, and per API key (a
second subject, counted by the same rules, taken in the same step). A key's spend is counted whether or not it has
limits, so a budget an admin adds mid-period starts from what the key already spent, not from zero.

One asyncio.Lock makes check-then-take atomic across all of a team's (and its key's) counters, so any
number of concurrent reserves admit exactly what the limits allow. The method set is what a Redis backend
(Lua scripts, one round trip each) implements for several replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenweir.gateway.state.backend import Lease
from tokenweir.policies.budget import DAY, MONTH, Budget, as_key_rejection, seconds_until_reset, spend_rejection
from tokenweir.policies.decisions import Rejected, budget_rejection, rate_rejection
from tokenweir.policies.limits import KeyLimits, TeamLimits, usd_micros
from tokenweir.policies.pricing import FEMTOS_PER_MICRO, femtos_to_usd, split_femtos
from tokenweir.policies.rate import SlidingWindow
from tokenweir.policies.reservation import Reservation
from tokenweir.policies.snapshot import (
    WindowHeaders,
    budget_view,
    ratelimit_headers,
    spend_view,
    team_snapshot,
    tighter,
)

_NO_KEY_LIMITS = KeyLimits()


@dataclass
class _SpendBudget(Budget):
    """A spend budget: `spent` / `reserved` / `overshoot` in whole micro-USD (what the checks compare, as the Redis
    hashes keep them), and `remainder`, the femto-USD of exact costs below a micro-dollar, carried into `spent` each
    time it reaches one. Settle and seed take femto-USD; holds are micro-USD."""

    remainder: int = 0

    @property
    def spent_femtos(self) -> int:
        return self.spent * FEMTOS_PER_MICRO + self.remainder

    def roll(self, now: float) -> None:
        key = self.key
        super().roll(now)
        if self.key != key:
            self.remainder = 0

    def settle(self, key: str, reserved: int, actual: int, now: float) -> int:
        """`Budget.settle` of an exact cost (`actual` femto-USD) against a hold of `reserved` micro-USD; the
        overshoot counts whole micro-USD beyond the hold, as the Redis SETTLE script does."""
        whole, below = split_femtos(actual)
        overshoot = super().settle(key, reserved, whole, now)  # rolls the period first
        carried, self.remainder = divmod(self.remainder + below, FEMTOS_PER_MICRO)
        self.spent += carried
        return overshoot

    def seed(self, spent: int, now: float) -> None:
        whole, below = split_femtos(spent)
        super().seed(whole, now)  # rolls the period first
        self.remainder = below


@dataclass
class _Team:
    """One subject's counters: a team's, or an API key's own (kept under the same rules)."""

    rpm: SlidingWindow | None = None
    tpm: SlidingWindow | None = None
    day: Budget = field(default_factory=lambda: Budget(DAY, None))
    month: Budget = field(default_factory=lambda: Budget(MONTH, None))
    day_cost: _SpendBudget = field(default_factory=lambda: _SpendBudget(DAY, None))
    month_cost: _SpendBudget = field(default_factory=lambda: _SpendBudget(MONTH, None))
    in_flight: int = 0
    reserved_tokens: int = 0  # held by unsettled reservations, whatever their period
    open_reservations: int = 0

    def sync_limits(self, limits: TeamLimits | KeyLimits) -> None:
        """Apply limits as they are now (an admin may change them at any time) without losing counts."""
        self.rpm = _resize(self.rpm, limits.rpm)
        self.tpm = _resize(self.tpm, limits.tpm)
        self.day.limit = limits.tokens_per_day
        self.month.limit = limits.tokens_per_month
        self.day_cost.limit = usd_micros(limits.usd_per_day)
        self.month_cost.limit = usd_micros(limits.usd_per_month)


def _resize(window: SlidingWindow | None, limit: int | None) -> SlidingWindow | None:
    if limit is None:
        return None
    if window is None:
        return SlidingWindow(limit)
    window.limit = limit
    return window


class InMemoryState:
    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._teams: dict[str, _Team] = {}
        self._keys: dict[str, _Team] = {}  # API keys' own counters, by key id

    def _team(self, team_id: str) -> _Team:
        team = self._teams.get(team_id)
        if team is None:
            team = self._teams[team_id] = _Team()
        return team

    def _key(self, key_id: str) -> _Team:
        key = self._keys.get(key_id)
        if key is None:
            key = self._keys[key_id] = _Team()
        return key

    async def reserve(
        self,
        team_id: str,
        limits: TeamLimits,
        prompt_tokens: int,
        max_tokens: int,
        now: float | None = None,
        *,
        key_id: str | None = None,
        key_limits: KeyLimits | None = None,
        cost: int = 0,
    ) -> Reservation:
        """Take 1 request on rpm and prompt + max_tokens on tpm and day / month budgets (cost on the spend
        budgets), from the team and, given key_id, the key: all or nothing."""
        assert prompt_tokens >= 0 and max_tokens >= 0 and cost >= 0
        n = prompt_tokens + max_tokens
        # No await from here to the return: atomic on the event loop, as the Redis backend's scripts are on Redis.
        now = self._clock() if now is None else now
        subjects: list[tuple[_Team, TeamLimits | KeyLimits]] = [(self._team(team_id), limits)]
        # A key without limits is still counted: a limit added later must see what it already spent.
        counted_key = key_id
        if counted_key is not None:
            subjects.append((self._key(counted_key), key_limits or _NO_KEY_LIMITS))
        for subject, subject_limits in subjects:
            subject.sync_limits(subject_limits)
        counted = [s for s, _ in subjects]
        for i, subject in enumerate(counted):
            try:
                self._check(subject, n, cost, now, lambda: _merged_headers(counted, now))
            except Rejected as r:
                raise (as_key_rejection(r) if i else r) from None
        day_key = month_key = ""
        for subject, _ in subjects:
            if subject.rpm is not None:
                subject.rpm.add(1, now)
            if subject.tpm is not None:
                subject.tpm.add(n, now)
            day_key = subject.day.reserve(n, now)
            month_key = subject.month.reserve(n, now)
            subject.day_cost.reserve(cost, now)
            subject.month_cost.reserve(cost, now)
            subject.reserved_tokens += n
            subject.open_reservations += 1
        headers = _merged_headers(counted, now)
        return Reservation(team_id, n, now, day_key, month_key, headers=headers, key_id=counted_key, cost=cost)

    def _check(self, team: _Team, n: int, cost: int, now: float, headers: Callable[[], dict[str, str]]) -> None:
        """Refuse what does not fit `team`; a refusal carries `headers()` (built only then: x-ratelimit-*)."""
        if team.rpm is not None and not team.rpm.fits(1, now):
            wait = team.rpm.wait_s(1, now)
            raise rate_rejection("requests", team.rpm.limit, team.rpm.remaining(now), 1, wait, headers())
        if team.tpm is not None and not team.tpm.fits(n, now):
            wait = team.tpm.wait_s(n, now)
            raise rate_rejection("tokens", team.tpm.limit, team.tpm.remaining(now), n, wait, headers())
        for budget in (team.day, team.month):
            if not budget.fits(n, now):
                reset = seconds_until_reset(budget.period, now)
                limit, remaining = budget.limit, budget.remaining(now)
                assert limit is not None and remaining is not None  # an unlimited budget fits anything
                raise budget_rejection(budget.period, limit, remaining, n, reset, headers())
        for budget in (team.day_cost, team.month_cost):
            if not budget.fits(cost, now):
                reset = seconds_until_reset(budget.period, now)
                limit, remaining = budget.limit, budget.remaining(now)
                assert limit is not None and remaining is not None  # an unlimited budget fits anything
                raise spend_rejection(budget.period, limit, remaining, cost, reset, headers())

    async def settle(
        self,
        reservation: Reservation,
        prompt_tokens: int,
        completion_tokens: int,
        now: float | None = None,
        *,
        cost: int = 0,
    ) -> Reservation:
        """Turn the hold into actual spend on every subject it took from, refunding the unused part. A second
        settle changes nothing."""
        assert prompt_tokens >= 0 and completion_tokens >= 0 and cost >= 0
        if reservation.settled:
            return reservation
        now = self._clock() if now is None else now
        actual = prompt_tokens + completion_tokens
        subjects = [self._team(reservation.team_id)]
        if reservation.key_id is not None:
            subjects.append(self._key(reservation.key_id))
        team_overshoot = 0
        for i, subject in enumerate(subjects):
            if subject.tpm is not None:
                if actual < reservation.tokens:
                    subject.tpm.refund(reservation.tokens - actual, reservation.taken_at, now)
                elif actual > reservation.tokens:
                    subject.tpm.add(actual - reservation.tokens, now)
            subject.day.settle(reservation.day_key, reservation.tokens, actual, now)
            overshoot = subject.month.settle(reservation.month_key, reservation.tokens, actual, now)
            subject.day_cost.settle(reservation.day_key, reservation.cost, cost, now)
            subject.month_cost.settle(reservation.month_key, reservation.cost, cost, now)
            subject.reserved_tokens = max(0, subject.reserved_tokens - reservation.tokens)
            subject.open_reservations -= 1
            if i == 0:
                team_overshoot = overshoot
        return reservation.mark_settled(actual, cost, team_overshoot)

    async def reserve_and_acquire(
        self,
        team_id: str,
        limits: TeamLimits,
        prompt_tokens: int,
        max_tokens: int,
        now: float | None = None,
        *,
        key_id: str | None = None,
        key_limits: KeyLimits | None = None,
        cost: int = 0,
        lease: Lease,
    ) -> tuple[Reservation, bool]:
        """`reserve`, then the lease's slots if it was taken: neither awaits anything, so no other request
        comes between them."""
        reservation = await self.reserve(
            team_id, limits, prompt_tokens, max_tokens, now, key_id=key_id, key_limits=key_limits, cost=cost
        )
        got = await self.acquire_slot(team_id, lease.max_concurrency, key_id=lease.key_id, key_max=lease.key_max)
        return reservation, got

    async def settle_and_release(
        self,
        reservation: Reservation,
        prompt_tokens: int,
        completion_tokens: int,
        now: float | None = None,
        *,
        cost: int = 0,
        lease: Lease | None = None,
    ) -> Reservation:
        """The lease's slots back (before any await: done even if the caller is cancelled), then `settle`."""
        if lease is not None:
            await self.release_slot(reservation.team_id, key_id=lease.key_id)
        return await self.settle(reservation, prompt_tokens, completion_tokens, now, cost=cost)

    async def acquire_slot(
        self,
        team_id: str,
        max_concurrency: int | None,
        *,
        key_id: str | None = None,
        key_max: int | None = None,
        lease_id: str | None = None,
    ) -> bool:
        """Take one of the team's concurrency slots (and one of the key's, given key_id); False if either is full.
        Release it in a finally, with the same key_id. (Slots here are counts: a lease_id names nothing.)"""
        subjects = [(self._team(team_id), max_concurrency)]
        if key_id is not None:
            subjects.append((self._key(key_id), key_max))
        if any(limit is not None and subject.in_flight >= limit for subject, limit in subjects):
            return False
        for subject, _ in subjects:
            subject.in_flight += 1
        return True

    async def release_slot(self, team_id: str, *, key_id: str | None = None, lease_id: str | None = None) -> None:
        # No await inside: completes even when called from a finally of a cancelled task.
        team = self._team(team_id)
        assert team.in_flight > 0, f"release_slot without acquire_slot for team {team_id}"
        team.in_flight -= 1
        if key_id is not None:
            key = self._key(key_id)
            assert key.in_flight > 0, f"release_slot without acquire_slot for key {key_id}"
            key.in_flight -= 1

    async def seed_spend(
        self,
        team_id: str,
        day_tokens: int,
        month_tokens: int,
        now: float | None = None,
        *,
        key_id: str | None = None,
        day_cost: int | None = None,
        month_cost: int | None = None,
    ) -> None:
        """Spend already in the store for the current UTC day / month, so a restart does not reset budgets: the
        team's, or with key_id that key's own; the spend budgets too when given (exact, in femto-USD)."""
        now = self._clock() if now is None else now
        subject = self._team(team_id) if key_id is None else self._key(key_id)
        subject.day.seed(day_tokens, now)
        subject.month.seed(month_tokens, now)
        if day_cost is not None:
            subject.day_cost.seed(day_cost, now)
        if month_cost is not None:
            subject.month_cost.seed(month_cost, now)

    async def snapshot(self, team_id: str, now: float | None = None, *, key_id: str | None = None) -> dict:
        """Live counters for the admin API and metrics (a team never seen reads as all zeros); with key_id, that
        API key's own counters. Limits are those of the last reserve: `policies.snapshot.with_limits` applies
        the current ones."""
        now = self._clock() if now is None else now
        team = (self._keys.get(key_id) if key_id is not None else self._teams.get(team_id)) or _Team()
        return team_snapshot(
            team_id,
            in_flight=team.in_flight,
            reserved_tokens=team.reserved_tokens,
            open_reservations=team.open_reservations,
            requests_last_minute=team.rpm.used(now) if team.rpm else None,
            tokens_last_minute=team.tpm.used(now) if team.tpm else None,
            remaining_requests=team.rpm.remaining(now) if team.rpm else None,
            remaining_tokens=team.tpm.remaining(now) if team.tpm else None,
            day=_budget_view(team.day, now),
            month=_budget_view(team.month, now),
            day_usd=_spend_budget_view(team.day_cost, now),
            month_usd=_spend_budget_view(team.month_cost, now),
        )

    async def ping(self) -> None:
        """Readiness: an in-process state is always up."""


def _budget_view(budget: Budget, now: float, view=budget_view) -> dict:
    budget.roll(now)
    return view(budget.period, budget.key, budget.limit, budget.spent, budget.reserved, budget.overshoot, now)


def _spend_budget_view(budget: _SpendBudget, now: float) -> dict:
    """`spend_view`, its spent rendered once from the exact femto-USD (limit / remaining are whole micro-USD)."""
    view = _budget_view(budget, now, spend_view)
    view["spent"] = femtos_to_usd(budget.spent_femtos)
    return view


def _window(window: SlidingWindow | None, now: float) -> WindowHeaders | None:
    if window is None:
        return None
    return WindowHeaders(window.limit, window.remaining(now), window.reset_s(now))


def _headers(team: _Team, now: float) -> dict[str, str]:
    return ratelimit_headers(_window(team.rpm, now), _window(team.tpm, now))


def _merged_headers(subjects: list[_Team], now: float) -> dict[str, str]:
    """x-ratelimit-* of the team, or where its key has less left, of the key."""
    if len(subjects) == 1:
        return _headers(subjects[0], now)
    team, key = subjects
    requests = tighter(_window(team.rpm, now), _window(key.rpm, now))
    tokens = tighter(_window(team.tpm, now), _window(key.tpm, now))
    return ratelimit_headers(requests, tokens)
