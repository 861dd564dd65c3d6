"""The prefix index replicas share through a Redis stream (gateway/upstream/shared_index.py), on the real Redis and on a
Redis Cluster: what one replica sent where, the other's index holds after a sync each; its own entries a replica skips;
a pool or member it does not know it leaves out; while Redis is away nothing is lost (bounded) and routing goes on from
what it has."""

from __future__ import annotations

import asyncio

import orjson
import redis.asyncio as aioredis

from tokenweir.gateway.config import GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.upstream.pools import Upstreams
from tokenweir.gateway.upstream.shared_index import SharedPrefixIndex

HASHES = [11, 22, 33, 44]


def replica() -> Upstreams:
    members = [UpstreamConfig(f"http://127.0.0.1:{9000 + i}", name=f"engine-{i}") for i in range(2)]
    return Upstreams(GatewayConfig(pools=[PoolConfig(model="m", upstreams=members)]))


async def test_what_one_replica_sent_routes_the_other(redis_at):
    state = redis_at()  # its client: the real Redis's, or a Redis Cluster's
    client, prefix = state.client, redis_at.prefix
    a, b = replica(), replica()
    shared_a = SharedPrefixIndex(client, prefix, lambda: a.pools)
    shared_b = SharedPrefixIndex(client, prefix, lambda: b.pools)
    try:
        a.on_record, b.on_record = shared_a.publish, shared_b.publish
        hop = a.plan("m")[1]  # engine-1 on replica a
        a.record(hop, HASHES)
        await shared_a.sync()
        await shared_b.sync()
        assert b.pools["m"].index.match(HASHES) == {"engine-1": 4}
        assert shared_b.learned == 1
        await shared_a.sync()  # its own entry comes back: skipped, no double count
        assert shared_a.learned == 0

        # a replica started later reads what the stream still holds
        c = replica()
        shared_c = SharedPrefixIndex(client, prefix, lambda: c.pools)
        await shared_c.sync()
        assert c.pools["m"].index.match(HASHES[:2]) == {"engine-1": 2}

        # a pool or member this replica does not know is left out
        shared_a.publish("other-pool", "engine-0", [5])
        shared_a.publish("m", "engine-9", [6])
        await shared_a.sync()
        await shared_b.sync()
        assert b.pools["m"].index.match([6]) == {} and shared_b.learned == 1
    finally:
        await client.delete(shared_a.stream)
        await state.close()


async def test_records_older_than_keep_s_are_trimmed(redis_at):
    state = redis_at()
    a = replica()
    shared = SharedPrefixIndex(state.client, redis_at.prefix, lambda: a.pools, keep_s=0.3)
    try:
        shared.publish("m", "engine-0", [1])
        await shared.sync()  # no trim before the first read
        await asyncio.sleep(0.5)
        shared.publish("m", "engine-0", [2])
        await shared.sync()
        shared.publish("m", "engine-0", [3])
        await shared.sync()  # trims what is older than 0.3 s before the newest read: the first entry
        entries = await state.client.xrange(shared.stream)
        assert [orjson.loads(fields["r"])[0][2] for _, fields in entries] == [[2], [3]]
    finally:
        await state.client.delete(shared.stream)
        await state.close()


async def test_redis_away_keeps_the_records_for_later_bounded(redis_prefix):
    client = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2, decode_responses=True)
    a = replica()
    shared = SharedPrefixIndex(client, redis_prefix, lambda: a.pools, max_pending=3)
    try:
        for i in range(5):
            shared.publish("m", "engine-0", [i])
        await shared.sync()
        assert [r[2] for r in shared.pending] == [[0], [1], [2]]
    finally:
        await client.aclose()
