"""The live limits state's contract, met by `InMemoryState` (one process, gateway/state/memory.py) and `RedisState`
(replicas sharing Redis, gateway/state/redis.py), and the one error every caller handles when a shared state cannot
answer."""

from __future__ import annotations

from typing import Protocol

from tokenweir.policies.limits import KeyLimits, TeamLimits
from tokenweir.policies.reservation import Reservation


class StateBackend(Protocol):
    """Live limits state: `InMemoryState` (one process) and `RedisState` (replicas sharing Redis) both are one.

    reserve: take 1 request on rpm and prompt + max_tokens on tpm and the day / month budgets (and `cost` micro-USD on
    the spend budgets, a bound rounded up), all or nothing (raises `Rejected`); with `key_id` the API key is a second
    subject whose counters are checked (against `key_limits`, None: none of its own) and taken in the same atomic step
    (the tighter wins). settle: turn the hold into actual spend on every subject it took from, refunding the rest
    (idempotent); its `cost` is the exact cost in femto-USD (policies.pricing), as is seed_spend's: spend budgets
    keep whole micro-USD (what the checks compare) and carry the femto-USD below a micro-dollar, so billed spend is
    exact. acquire_slot / release_slot: the team's (and the key's) concurrency slots. A backend that cannot be
    reached raises `StateUnavailable`."""

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
    ) -> Reservation: ...

    async def settle(
        self,
        reservation: Reservation,
        prompt_tokens: int,
        completion_tokens: int,
        now: float | None = None,
        *,
        cost: int = 0,
    ) -> Reservation: ...

    # lease_id: the caller's name for the lease, to release that one (a shared state's; this process's ignore it)
    async def acquire_slot(
        self,
        team_id: str,
        max_concurrency: int | None,
        *,
        key_id: str | None = None,
        key_max: int | None = None,
        lease_id: str | None = None,
    ) -> bool: ...

    async def release_slot(self, team_id: str, *, key_id: str | None = None, lease_id: str | None = None) -> None: ...

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
    ) -> None: ...

    async def snapshot(self, team_id: str, now: float | None = None, *, key_id: str | None = None) -> dict: ...

    async def ping(self) -> None: ...


class StateUnavailable(Exception):
    """The shared state backend cannot be reached (or did not answer in time).

    `pending` is set when the failed call changed state that must still change (a settle, a slot release): the
    caller keeps it in the outbox, and `replay(pending)` on the backend applies it later (idempotent)."""

    def __init__(self, message: str, pending: dict | None = None) -> None:
        super().__init__(message)
        self.pending = pending
