"""How `RedisState` reaches Redis: the client of one server or of a Redis Cluster, with its pools, timeouts and
retries, and the request path's two hot scripts (RESERVE, SETTLE) sent lean over it (gateway.state.redis_wire on one
server, gateway.state.redis_cluster_wire on a cluster). Kept apart from the state's methods, which only say what to
ask of Redis, not how a call gets there.
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.maint_notifications import MaintNotificationsConfig

from tokenweir.gateway.state.backend import StateUnavailable
from tokenweir.gateway.state.redis_cluster_wire import ClusterHotScript, ClusterLines
from tokenweir.gateway.state.redis_lua import RESERVE, SETTLE
from tokenweir.gateway.state.redis_wire import HotLine, HotScript, RedisClient

# What a call to an unreachable, slow or overloaded Redis raises (a pool that waited in vain raises
# ConnectionError("No connection available"), a command past its socket timeout TimeoutError). Under uvloop a
# write on a connection Redis reset raises RuntimeError ("unable to perform operation on <TCPTransport
# closed=True>"), not an OSError. A cluster's client also raises RedisClusterException, not a RedisError (no node
# reachable, a slot no node serves).
REDIS_ERRORS = (redis.RedisError, RedisClusterException, OSError, TimeoutError, RuntimeError)


class RedisConnection:
    """The client and the two hot scripts over it.

    On one server a blocking pool of up to `max_connections` waits up to `pool_timeout_s` for a free connection
    instead of failing at once. With `cluster`, `url` names one node of a Redis Cluster (any; the others are found
    from it); each node then has a pool of its own of up to `max_connections`, which raises at once when full
    instead of waiting `pool_timeout_s` (redis-py's cluster client has no blocking pool; the request path's two
    calls use no pooled connection). Every call has a socket timeout of `timeout_s`."""

    def __init__(
        self, url: str, *, max_connections: int, pool_timeout_s: float, timeout_s: float, cluster: bool
    ) -> None:
        self.client: RedisClient
        self.reserve: HotScript | ClusterHotScript
        self.settle: HotScript | ClusterHotScript
        self.line: HotLine | None = None  # one server's lean wire, where the pool allows one
        self.lines: ClusterLines | None = None  # a cluster's lean wires, one per primary
        timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        if cluster:
            # no retries: a command whose connection was lost may have run (ACQUIRE twice takes two leases), and a
            # cluster client retrying a pipeline first closes every connection, those of other callers too
            cluster_client = aioredis.RedisCluster.from_url(
                url, max_connections=max_connections, decode_responses=True, retry=Retry(NoBackoff(), 0), **timeouts
            )
            self.client, self.lines = cluster_client, ClusterLines(cluster_client)
            self.reserve = ClusterHotScript(self.lines, RESERVE)
            self.settle = ClusterHotScript(self.lines, SETTLE)
        else:
            pool = aioredis.BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=pool_timeout_s,
                decode_responses=True,
                # off (its default is on where the server offers them), so that the pool checks each connection it
                # hands out and reconnects one Redis closed while it sat idle (after a restart or a cut)
                maint_notifications_config=MaintNotificationsConfig(enabled=False),
                **timeouts,
            )
            self.client = client = aioredis.Redis(connection_pool=pool)
            # a request's two calls go lean (gateway.state.redis_wire), their arguments packed from caches
            self.line = HotLine(pool.connection_kwargs) if HotLine.serves(pool) else None
            self.reserve = HotScript(client, RESERVE, self.line)
            self.settle = HotScript(client, SETTLE, self.line)

    async def ping(self) -> None:
        """Readiness: StateUnavailable when Redis (on a cluster, any primary) does not answer."""
        try:
            if isinstance(self.client, aioredis.RedisCluster):
                await self.client.ping(target_nodes=aioredis.RedisCluster.PRIMARIES)
            else:
                await self.client.ping()
        except REDIS_ERRORS as e:
            raise StateUnavailable(f"ping: {type(e).__name__}: {e}") from e

    async def close(self) -> None:
        if self.line is not None:
            self.line.close()
        if self.lines is not None:
            self.lines.close()
        await self.client.aclose()
