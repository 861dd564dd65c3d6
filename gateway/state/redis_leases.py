"""The concurrency leases one `RedisState` (one replica) holds: taking one alone, giving one back alone, renewal.

A lease is taken in Redis by the ACQUIRE script (`acquire`) or together with a reservation (RESERVE), and given back
alone (`release`) or together with its settle (SETTLE); this book is the replica's own list of what it holds, so that
a background task pushes out their expiry every lease_s / 3 (a replica that dies stops renewing: its leases lapse by
expiry) and a replica puts them back after Redis lost its data (gateway.state.redis_epoch).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable

from tokenweir.gateway.state.backend import Lease, StateUnavailable
from tokenweir.gateway.state.redis_calls import lim
from tokenweir.gateway.state.redis_keys import RedisKeyLayout
from tokenweir.gateway.state.redis_lua import ACQUIRE, ACQUIRE_ARGV, RENEW, script_args
from tokenweir.gateway.state.redis_wire import RedisClient


class LeaseBook:
    def __init__(
        self,
        client: RedisClient,
        keys: RedisKeyLayout,
        lease_s: float,
        clock: Callable[[], float],
        errors: tuple[type[BaseException], ...],
    ) -> None:
        self._client, self._keys, self.lease_s, self._clock, self._errors = client, keys, lease_s, clock, errors
        self._acquire = client.register_script(ACQUIRE)
        self._renew = client.register_script(RENEW)
        self.leases: dict[tuple[str, str | None], list[str]] = {}  # live leases per (team, key or None)
        self._renewer: asyncio.Task | None = None

    async def acquire(
        self, team_id: str, key_id: str | None, lease_id: str, max_concurrency: int | None, key_max: int | None
    ) -> bool:
        """Take `lease_id` on the team's slots (and the key's, given key_id) if each has one free under its limit;
        renewed from then on. False: a slot is full and nothing was taken."""
        args = script_args(
            ACQUIRE_ARGV,
            now=repr(self._clock()),
            lease_s=self.lease_s,
            max_concurrency=lim(max_concurrency),
            lease_id=lease_id,
            key_max_concurrency=lim(key_max),
        )
        try:
            if not await self._acquire(keys=self._keys.slot_keys(team_id, key_id), args=args):
                return False
        except self._errors as e:
            # The lease may have been taken before the answer was lost: release it, or it would hold one of the
            # team's slots until it expires.
            undo = Lease(lease_id, key_id).release_op(team_id)
            raise StateUnavailable(f"acquire_slot: {type(e).__name__}: {e}", pending=undo) from e
        self.taken(team_id, key_id, lease_id)
        return True

    async def release(self, team_id: str, key_id: str | None, lease_id: str) -> None:
        """Remove a lease from its slots in Redis (one already gone removes nothing); `dropped` forgets it here."""
        if key_id is None:
            await self._client.zrem(self._keys.key(team_id, "slots"), lease_id)
            return
        async with self._client.pipeline(transaction=True) as pipe:
            for slots in self._keys.slot_keys(team_id, key_id):
                pipe.zrem(slots, lease_id)
            await pipe.execute()

    def taken(self, team_id: str, key_id: str | None, lease_id: str) -> None:
        """A lease Redis granted: renewed from now on until `dropped`."""
        self.leases.setdefault((team_id, key_id), []).append(lease_id)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_loop())

    def dropped(self, team_id: str, key_id: str | None, lease_id: str | None) -> str:
        """Forget one lease before it is released in Redis (so a cancellation during that round trip still stops
        its renewal): `lease_id`, else the newest. Returns the one dropped."""
        leases = self.leases.get((team_id, key_id))
        assert leases, f"release_slot without acquire_slot for team {team_id}"
        if lease_id is None or lease_id not in leases:
            lease_id = leases.pop()
        else:
            leases.remove(lease_id)
        if not leases:
            del self.leases[(team_id, key_id)]
        return lease_id

    async def renew(self) -> None:
        """Push out the expiry of every lease held (the background task calls this)."""
        expiry = repr(self._clock() + self.lease_s)
        ttl_ms = math.ceil(self.lease_s * 1000) + 1000
        for (team_id, key_id), leases in list(self.leases.items()):
            if leases:
                # ARGV: expiry, ttl_ms, then every lease id (see state_redis_lua.RENEW)
                for slots in self._keys.slot_keys(team_id, key_id):
                    await self._renew(keys=[slots], args=[expiry, ttl_ms, *leases])

    async def _renew_loop(self) -> None:
        while self.leases:
            await asyncio.sleep(self.lease_s / 3)
            with contextlib.suppress(*self._errors):  # Redis is away: next round (a lease lasts three)
                await self.renew()

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
