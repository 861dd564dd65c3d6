"""How many requests each pool member (an engine) serves at once, counted across every gateway replica: a member's
`max_parallel_requests` is its own limit, not one per replica.

With the shared state in Redis each request holds a lease in its member's slots zset
(`<prefix>:member:{<base_url>}:slots`, taken by the same ACQUIRE script as a team's concurrency lease): renewed while
the request runs, given back at its end, and lapsing `lease_s` after a replica that died stopped renewing it. In one
process (no Redis) this replica's own count is the whole count.

A member cap protects an engine; it must not turn a Redis outage into refused requests. While Redis does not answer,
this replica's own count decides (at most the member's limit from this replica); a lease whose answer was lost is never
renewed and lapses.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from tokenweir.common.ids import random_hex
from tokenweir.gateway.state.backend import StateBackend
from tokenweir.gateway.state.redis import RedisState
from tokenweir.gateway.state.redis_calls import lim
from tokenweir.gateway.state.redis_connection import REDIS_ERRORS
from tokenweir.gateway.state.redis_keys import RedisKeyLayout
from tokenweir.gateway.state.redis_leases import LeaseBook
from tokenweir.gateway.state.redis_lua import ACQUIRE, ACQUIRE_ARGV, script_args

LOCAL = "local-"  # a lease id this replica counted alone (Redis did not answer when it was taken)


class MemberSlots:
    def __init__(self, state: StateBackend | None = None, *, lease_s: float = 10.0, clock: Callable = time.time):
        self.held: dict[str, int] = {}  # member -> this replica's requests on it
        self._redis = state if isinstance(state, RedisState) else None
        self._clock = clock
        self.lease_s = lease_s
        if self._redis is not None:
            client = self._redis.client
            self._keys = RedisKeyLayout(self._redis.keys.prefix + ":member")
            self._acquire = client.register_script(ACQUIRE)
            self._book = LeaseBook(client, self._keys, lease_s, clock, REDIS_ERRORS)

    @property
    def shared(self) -> bool:
        return self._redis is not None

    async def take(self, member: str, limit: int) -> str | None:
        """One of `member`'s `limit` slots: the lease's id, or None when every slot is taken."""
        mine = self.held.get(member, 0)
        if mine >= limit:
            return None
        self.held[member] = mine + 1  # before the round trip: a request taken meanwhile sees this one
        lease_id = random_hex()
        if self._redis is None:
            return lease_id
        args = script_args(
            ACQUIRE_ARGV,
            now=repr(self._clock()),
            lease_s=self.lease_s,
            max_concurrency=limit,
            lease_id=lease_id,
            key_max_concurrency=lim(None),
        )
        try:
            granted = await self._acquire(keys=self._keys.slot_keys(member), args=args)
        except REDIS_ERRORS:
            # this replica's own count (taken above) decides; a lease Redis may have granted is never renewed (it is
            # not in the book) and lapses
            return LOCAL + lease_id
        except BaseException:
            self._uncount(member)
            raise
        if not granted:
            self._uncount(member)
            return None
        self._book.taken(member, None, lease_id)
        return lease_id

    async def give_back(self, member: str, lease_id: str) -> None:
        """The request on `member` ended: once per lease. Redis away: the lease lapses."""
        self._uncount(member)
        if self._redis is None or lease_id.startswith(LOCAL):
            return
        self._book.dropped(member, None, lease_id)
        with contextlib.suppress(*REDIS_ERRORS):
            await self._redis_release(member, lease_id)

    def _uncount(self, member: str) -> None:
        self.held[member] -= 1
        if not self.held[member]:
            del self.held[member]

    async def _redis_release(self, member: str, lease_id: str) -> None:
        assert self._redis is not None
        await self._redis.client.zrem(self._keys.key(member, "slots"), lease_id)

    async def in_use(self, member: str) -> int:
        """Live leases on `member` across every replica (this replica's count without Redis)."""
        if self._redis is None:
            return self.held.get(member, 0)
        return int(await self._redis.client.zcount(self._keys.key(member, "slots"), f"({self._clock()!r}", "+inf"))

    async def close(self) -> None:
        if self._redis is not None:
            await self._book.close()
