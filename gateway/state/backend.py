"""The live limits state's contract, met by `InMemoryState` (one process, gateway/state/memory.py) and `RedisState`
(replicas sharing Redis, gateway/state/redis.py), and the one error every caller handles when a shared state cannot
answer."""

from __future__ import annotations

from dataclasses import dataclass
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
    exact. acquire_slot / release_slot: the team's (and the key's) concurrency slots. reserve_and_acquire and
    settle_and_release are a request's two steps, each one atomic step (one round trip on a shared state): the
    reservation and its `Lease` taken together (the lease only if the reservation was; a full slot leaves the
    reservation taken and answers False), then settled and given back together. A backend that cannot be reached
    raises `StateUnavailable`."""

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
    ) -> tuple[Reservation, bool]: ...

    async def settle_and_release(
        self,
        reservation: Reservation,
        prompt_tokens: int,
        completion_tokens: int,
        now: float | None = None,
        *,
        cost: int = 0,
        lease: Lease | None = None,
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


@dataclass(frozen=True, slots=True)
class Lease:
    """A request's concurrency lease: one of its team's slots, and one of its API key's own where `key_id` is set
    (a key with a cap of its own). `lease_id` is the caller's name for it, chosen (and journaled) before it is taken,
    so that a restart after the process died can release it by name; the caps matter only to taking it."""

    lease_id: str
    key_id: str | None = None
    max_concurrency: int | None = None  # the team's cap (None: unlimited)
    key_max: int | None = None  # the key's own cap

    def release_op(self, team_id: str) -> dict:
        """Its release, as the outbox and the in-flight journal replay it (`RedisState.replay`)."""
        return {"op": "release_slot", "team_id": team_id, "lease_id": self.lease_id, "key_id": self.key_id}


class StateUnavailable(Exception):
    """The shared state backend cannot be reached (or did not answer in time).

    `pending` is set when the failed call changed state that must still change (a settle, a slot release): the
    caller keeps it in the outbox, and `replay(pending)` on the backend applies it later (idempotent)."""

    def __init__(self, message: str, pending: dict | None = None) -> None:
        super().__init__(message)
        self.pending = pending
