"""The prefix index shared by every gateway replica: what each one sent where reaches the others' indexes, so every
replica routes a team's prompts to the engine that already holds them (each replica learning alone sent one team to
two engines).

Through one Redis stream (`<prefix>:prefix-log`): each replica appends what its dispatches recorded since its last
turn as one entry (pool, instance, block hashes; batched, off the request path), reads the entries appended since its
last read, and records the other replicas' into its own pools' indexes. Bounded by age: each append trims the entries
older than `keep_s` before the newest one read (the stream's ids: the Redis server's clock), so its memory follows the
request rate (~30 s of records: ~25 MB at 1,000 requests/s of 600-token prompts), and a replica that starts reads
what is there and so begins warm. Evictions need no sharing:
every replica polls every engine's /load, whose eviction log each applies itself. Best effort: while Redis does not
answer, a replica routes by what it learned alone, and its unsent records wait (at most `max_pending`).
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisClusterException

from tokenweir.common.ids import random_hex
from tokenweir.common.logging import get_logger
from tokenweir.gateway.upstream.periodic import Periodic
from tokenweir.gateway.upstream.pools import Pool

log = get_logger()

# as the state backend counts them (a cluster client raises RedisClusterException, not a RedisError, when no node
# answers)
RedisFailure = (redis.RedisError, RedisClusterException, OSError, TimeoutError, RuntimeError)


class SharedPrefixIndex:
    def __init__(
        self,
        client: aioredis.Redis | aioredis.RedisCluster,
        key_prefix: str,
        pools: Callable[[], dict[str, Pool]],
        *,
        keep_s: float = 30.0,
        max_pending: int = 10_000,
        read_count: int = 1_000,
    ) -> None:
        self.client, self.pools = client, pools
        self.stream = f"{key_prefix}:prefix-log"
        self.origin = random_hex()  # this replica, so that it skips its own entries
        self.keep_ms, self.max_pending, self.read_count = int(keep_s * 1000), max_pending, read_count
        self.pending: list[tuple[str, str, list[int]]] = []  # (pool, instance, block hashes) not sent yet
        self.last_id = "0-0"  # the newest entry read
        self.learned = 0  # records of other replicas applied here
        self.poll = Periodic(self.sync, "prefix_index_sync_failed")

    def publish(self, pool: str, instance: str, hashes: list[int]) -> None:
        """This replica sent `instance` of `pool` a prompt with these block hashes (its own index has them)."""
        if len(self.pending) < self.max_pending:
            self.pending.append((pool, instance, hashes))

    async def sync(self) -> None:
        """Append this replica's records as one entry, then apply every other replica's entries since the last read."""
        pending = self.pending
        self.pending = []
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                if pending:
                    fields = {"o": self.origin, "r": orjson.dumps(pending)}
                    newest_ms = int(self.last_id.split("-")[0])  # none trimmed before the first read
                    minid = str(newest_ms - self.keep_ms) if newest_ms > self.keep_ms else None
                    pipe.xadd(self.stream, fields, minid=minid, approximate=False)  # type: ignore[arg-type]
                pipe.xread({self.stream: self.last_id}, count=self.read_count)
                replies = await pipe.execute()
        except RedisFailure as exc:
            self.pending = (pending + self.pending)[: self.max_pending]
            log.warning("prefix_index_sync_failed", error=type(exc).__name__)
            return
        for _, entries in replies[-1] or []:
            for entry_id, fields in entries:
                self.last_id = entry_id
                if fields.get("o") != self.origin:
                    self.apply(fields.get("r"))

    def apply(self, records: str | bytes | None) -> None:
        """Another replica's records, into this replica's indexes (a pool or member it does not know: skipped)."""
        if not records:
            return
        pools = self.pools()
        for pool_name, instance, hashes in orjson.loads(records):
            pool = pools.get(pool_name)
            if pool is not None and pool.member(instance) is not None:
                pool.index.record(instance, hashes)
                self.learned += 1
