"""In-process live state: rate windows, budget reservations and concurrency slots per team.

One asyncio.Lock makes check-then-take atomic across all of a team's counters (rpm, tpm, day, month), so any
number of concurrent reserves admit exactly what the limits allow. The method set is what a Redis backend
(Lua scripts, one round trip each) implements for several replicas.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

from policies.budget import DAY, MONTH, Budget, seconds_until_reset
from policies.decisions import budget_rejection, rate_rejection
from policies.limits import TeamLimits
from policies.rate import SlidingWindow
from policies.reservation import Reservation
from policies.snapshot import WindowHeaders, budget_view, ratelimit_headers, team_snapshot


class StateBackend(Protocol):
    """Live limits state: `InMemoryState` (one process) and `RedisState` (replicas sharing Redis) both are one.

    reserve: take 1 request on rpm and prompt + max_tokens on tpm and the day / month budgets, all or nothing
    (raises `Rejected`); settle: turn the hold into actual spend, refunding the rest (idempotent); acquire_slot /
    release_slot: the team's concurrency slots. A backend that cannot be reached raises `StateUnavailable`."""

    async def reserve(
        self, team_id: str, limits: TeamLimits, prompt_tokens: int, max_tokens: int, now: float | None = None
    ) -> Reservation: ...

    async def settle(
        self, reservation: Reservation, prompt_tokens: int, completion_tokens: int, now: float | None = None
    ) -> Reservation: ...

    async def acquire_slot(self, team_id: str, max_concurrency: int | None) -> bool: ...

    async def release_slot(self, team_id: str) -> None: ...

    def seed_spend(self, team_id: str, day_tokens: int, month_tokens: int, now: float | None = None) -> None: ...

    def snapshot(self, team_id: str, now: float | None = None) -> dict: ...

    async def read_snapshot(self, team_id: str) -> dict: ...

    async def ping(self) -> None: ...


class StateUnavailable(Exception):
    """The shared state backend cannot be reached (or did not answer in time).

    `pending` is set when the failed call changed state that must still change (a settle, a slot release): the
    caller keeps it in the outbox, and `replay(pending)` on the backend applies it later (idempotent)."""

    def __init__(self, message: str, pending: dict | None = None) -> None:
        super().__init__(message)
        self.pending = pending


@dataclass
class _Team:
    rpm: SlidingWindow | None = None
    tpm: SlidingWindow | None = None
    day: Budget = field(default_factory=lambda: Budget(DAY, None))
    month: Budget = field(default_factory=lambda: Budget(MONTH, None))
    in_flight: int = 0
    reserved_tokens: int = 0  # held by unsettled reservations, whatever their period
    open_reservations: int = 0

    def sync_limits(self, limits: TeamLimits) -> None:
        """Apply limits as they are now (an admin may change them at any time) without losing counts."""
        self.rpm = _resize(self.rpm, limits.rpm)
        self.tpm = _resize(self.tpm, limits.tpm)
        self.day.limit = limits.tokens_per_day
        self.month.limit = limits.tokens_per_month


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
        self._lock = asyncio.Lock()
        self._teams: dict[str, _Team] = {}

    def _team(self, team_id: str) -> _Team:
        team = self._teams.get(team_id)
        if team is None:
            team = self._teams[team_id] = _Team()
        return team

    async def reserve(
        self, team_id: str, limits: TeamLimits, prompt_tokens: int, max_tokens: int, now: float | None = None
    ) -> Reservation:
        """Take 1 request on rpm and prompt + max_tokens on tpm and day / month budgets, all or nothing."""
        assert prompt_tokens >= 0 and max_tokens >= 0
        n = prompt_tokens + max_tokens
        async with self._lock:
            now = self._clock() if now is None else now
            team = self._team(team_id)
            team.sync_limits(limits)
            self._check(team, n, now)
            if team.rpm is not None:
                team.rpm.add(1, now)
            if team.tpm is not None:
                team.tpm.add(n, now)
            day_key = team.day.reserve(n, now)
            month_key = team.month.reserve(n, now)
            team.reserved_tokens += n
            res = Reservation(team_id, n, now, day_key, month_key, headers=_headers(team, now))
            team.open_reservations += 1
            return res

    def _check(self, team: _Team, n: int, now: float) -> None:
        if team.rpm is not None and not team.rpm.fits(1, now):
            wait = team.rpm.wait_s(1, now)
            raise rate_rejection("requests", team.rpm.limit, team.rpm.remaining(now), 1, wait, _headers(team, now))
        if team.tpm is not None and not team.tpm.fits(n, now):
            wait = team.tpm.wait_s(n, now)
            raise rate_rejection("tokens", team.tpm.limit, team.tpm.remaining(now), n, wait, _headers(team, now))
        for budget in (team.day, team.month):
            if not budget.fits(n, now):
                reset = seconds_until_reset(budget.period, now)
                remaining = budget.remaining(now)
                raise budget_rejection(budget.period, budget.limit, remaining, n, reset, _headers(team, now))

    async def settle(
        self, reservation: Reservation, prompt_tokens: int, completion_tokens: int, now: float | None = None
    ) -> Reservation:
        """Turn the hold into actual spend, refunding the unused part. A second settle changes nothing."""
        assert prompt_tokens >= 0 and completion_tokens >= 0
        async with self._lock:
            if reservation.settled:
                return reservation
            now = self._clock() if now is None else now
            actual = prompt_tokens + completion_tokens
            team = self._team(reservation.team_id)
            if team.tpm is not None:
                if actual < reservation.tokens:
                    team.tpm.refund(reservation.tokens - actual, reservation.taken_at, now)
                elif actual > reservation.tokens:
                    team.tpm.add(actual - reservation.tokens, now)
            team.day.settle(reservation.day_key, reservation.tokens, actual, now)
            reservation.overshoot = team.month.settle(reservation.month_key, reservation.tokens, actual, now)
            team.reserved_tokens = max(0, team.reserved_tokens - reservation.tokens)
            reservation.settled = True
            reservation.actual_tokens = actual
            team.open_reservations -= 1
            return reservation

    async def acquire_slot(self, team_id: str, max_concurrency: int | None) -> bool:
        """Take one of the team's concurrency slots; False if all are taken. Release it in a finally."""
        team = self._team(team_id)
        if max_concurrency is not None and team.in_flight >= max_concurrency:
            return False
        team.in_flight += 1
        return True

    async def release_slot(self, team_id: str) -> None:
        # No await inside: completes even when called from a finally of a cancelled task.
        team = self._team(team_id)
        assert team.in_flight > 0, f"release_slot without acquire_slot for team {team_id}"
        team.in_flight -= 1

    def seed_spend(self, team_id: str, day_tokens: int, month_tokens: int, now: float | None = None) -> None:
        """Spend already in the store for the current UTC day / month, so a restart does not reset budgets."""
        now = self._clock() if now is None else now
        team = self._team(team_id)
        team.day.seed(day_tokens, now)
        team.month.seed(month_tokens, now)

    def snapshot(self, team_id: str, now: float | None = None) -> dict:
        """Live counters for the admin API and metrics (a team never seen reads as all zeros)."""
        now = self._clock() if now is None else now
        team = self._teams.get(team_id) or _Team()
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
        )

    async def read_snapshot(self, team_id: str) -> dict:
        """`snapshot` for async callers (the Redis backend reads over the network)."""
        return self.snapshot(team_id)

    async def ping(self) -> None:
        """Readiness: an in-process state is always up."""


def _budget_view(budget: Budget, now: float) -> dict:
    budget.roll(now)
    return budget_view(budget.period, budget.key, budget.limit, budget.spent, budget.reserved, budget.overshoot, now)


def _window(window: SlidingWindow | None, now: float) -> WindowHeaders | None:
    if window is None:
        return None
    return WindowHeaders(window.limit, window.remaining(now), window.reset_s(now))


def _headers(team: _Team, now: float) -> dict[str, str]:
    return ratelimit_headers(_window(team.rpm, now), _window(team.tpm, now))
