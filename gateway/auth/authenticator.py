"""Who is calling: API key -> (key, team), through a short TTL cache so the store is off the request path.

The cache holds a lookup for at most `cache_ttl_s` (<= 1 s), so a revoked key, a disabled team or new limits
take effect within about a second on every replica, without any invalidation message between them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.store import keys
from tokenweir.gateway.store.db import DB_ERRORS
from tokenweir.gateway.store.store import ApiKey, Store, Team

# Unknown secrets are cached too (a brute force must not hammer the store), so bound the memory.
_MAX_CACHED = 10_000
log = logging.getLogger("tokenweir.auth")


@dataclass(frozen=True)
class Principal:
    key: ApiKey
    team: Team | None  # None for an admin key that belongs to no team

    def may_use(self, model: str) -> bool:
        """Whether both the team's and the key's own allowed models include `model` (a teamless key: none)."""
        if self.team is None or not self.team.limits.allows_model(model):
            return False
        return self.key.limits is None or self.key.limits.allows_model(model)


def invalid_key(message: str) -> APIError:
    return APIError(401, message, "invalid_api_key")


class Authenticator:
    def __init__(self, store: Store, cache_ttl_s: float = 1.0, max_stale_s: float = 30.0) -> None:
        assert 0 <= cache_ttl_s <= 1.0, "a longer TTL would let a revoked key live past the 2 s promise"
        self.store = store
        self.cache_ttl_s = cache_ttl_s
        # While the store is unreachable, a key seen recently keeps working this long past its TTL: a database
        # blip must not log every team out. Nothing can be revoked during the outage anyway (same database).
        self.max_stale_s = max_stale_s
        # sha256(secret) -> (monotonic deadline, key, team); keyed by hash so no secret is kept in memory
        self._cache: dict[str, tuple[float, ApiKey | None, Team | None]] = {}
        self._inflight: dict[str, asyncio.Task] = {}
        self._generation = 0  # bumped by invalidate(): a read that started before it must not refill the cache

    def invalidate(self) -> None:
        """Forget every cached lookup (the admin API calls this so its own replica sees changes at once)."""
        self._cache.clear()
        self._generation += 1

    async def authenticate(self, secret: str | None) -> Principal:
        if not secret:
            raise invalid_key(
                "You didn't provide an API key. Pass it in the Authorization header: 'Authorization: Bearer tw-...'."
            )
        if not keys.is_well_formed(secret):
            raise invalid_key("Malformed API key: tokenweir keys are 'tw-' followed by 43 URL-safe characters.")
        key, team = await self._lookup(secret)
        shown = keys.masked(secret)
        if key is None:
            raise invalid_key(f"Incorrect API key provided: {shown}. Ask your gateway admin for a valid key.")
        if key.revoked_at is not None:
            raise invalid_key(f"The API key {shown} was revoked at {key.revoked_at}.")
        if key.is_expired(datetime.now(UTC)):  # checked on every call, not cached: expiry is exact
            raise invalid_key(f"The API key {shown} expired at {key.expires_at}.")
        if key.team_id is not None:
            if team is None:  # deleted between the two reads
                raise invalid_key(f"Incorrect API key provided: {shown}. Its team no longer exists.")
            if not team.enabled:
                raise APIError(403, f"Team '{team.name}' is disabled; ask your gateway admin.", "team_disabled")
        return Principal(key=key, team=team)

    async def _lookup(self, secret: str) -> tuple[ApiKey | None, Team | None]:
        digest = keys.hash_secret(secret)
        hit = self._cache.get(digest)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            return hit[1], hit[2]
        # Single flight: a burst of requests with one key after expiry costs one store read, not hundreds.
        # The read runs in its own task so one caller's cancellation (client gone) cannot fail the others.
        task = self._inflight.get(digest)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fill(digest, secret))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if nobody waits
            self._inflight[digest] = task
        try:
            return await asyncio.shield(task)
        except DB_ERRORS as exc:
            if hit is not None and now - hit[0] <= self.max_stale_s:
                log.warning("key store unavailable, serving a cached key lookup: %s", exc)
                return hit[1], hit[2]
            raise APIError(
                503, "The key store is unavailable; retry shortly.", "store_unavailable", headers={"Retry-After": "1"}
            ) from exc

    async def _fill(self, digest: str, secret: str) -> tuple[ApiKey | None, Team | None]:
        generation = self._generation
        try:
            key, team = await asyncio.to_thread(self._load, secret)
        finally:
            del self._inflight[digest]
        if len(self._cache) >= _MAX_CACHED:
            now = time.monotonic()
            self._cache = {d: v for d, v in self._cache.items() if v[0] > now}
            if len(self._cache) >= _MAX_CACHED:
                self._cache.clear()
        if generation == self._generation:
            self._cache[digest] = (time.monotonic() + self.cache_ttl_s, key, team)
        return key, team

    def _load(self, secret: str) -> tuple[ApiKey | None, Team | None]:
        key = self.store.find_key(secret)
        team = self.store.get_team(key.team_id) if key is not None and key.team_id is not None else None
        return key, team
