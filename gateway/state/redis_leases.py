"""The concurrency leases one `RedisState` (one replica) holds, and their renewal.

A lease is taken in Redis by the ACQUIRE script or together with a reservation (RESERVE), and given back alone or
together with its settle (SETTLE); this book is the replica's own list of what it holds, so that a background task
pushes out their expiry every lease_s / 3 (a replica that dies stops renewing: its leases lapse by expiry) and a
replica puts them back after Redis lost its data (gateway.state.redis_epoch).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable

from tokenweir.gateway.state.redis_keys import RedisKeyLayout
from tokenweir.gateway.state.redis_lua import RENEW
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
        self._keys, self.lease_s, self._clock, self._errors = keys, lease_s, clock, errors
        self._renew = client.register_script(RENEW)
        self.leases: dict[tuple[str, str | None], list[str]] = {}  # live leases per (team, key or None)
        self._renewer: asyncio.Task | None = None

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
