"""The request's two hot scripts (RESERVE, SETTLE) on a Redis Cluster, as lean as on one server: packed once and sent
pipelined on a connection of their own (gateway.state.redis_wire's `HotLine`), one per primary, the primary that
serves the slot of the call's first key. Every key of one call carries its team's `{team}` hash tag
(gateway.state.redis_keys), so they all live in that slot. The slot map is the cluster client's own
(`RedisCluster.nodes_manager`): read at the first call, patched on MOVED, read again before the next call after one
failed in a way that can mean it is stale (a lost connection, a timeout, CLUSTERDOWN).

Not the cluster client's evalsha: its path per command (policy lookup, key parsing, pool checkout, metrics hooks)
costs several times the CPU of the round trip, and it sends a command again after its connection was lost, which for
RESERVE would take a hold twice (one never given back). Here a call is sent again only where Redis said it did not
run it:
  MOVED     the slot has a new owner (a failover, a resharding): the map is patched, the call goes to the owner named;
  ASK       the slot is being migrated and the call's keys are on the target: ASKING then the call, on one connection;
  TRYAGAIN  a call whose keys a migration has split for now: again after 50 ms;
  NOSCRIPT  this primary lacks the script (a replica promoted since): loaded there, then again.
A lost connection, a timeout and CLUSTERDOWN (a failover under way) are raised as they are, as on one server: the
caller answers 503 state_unavailable and undoes what may have run through the outbox. TLS (rediss://) keeps the
cluster client's pooled connections to each primary for these calls.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MovedError,
    NoScriptError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenweir.gateway.state.redis_wire import ASKING, HotLine, bulk, bulks

REDIRECTS = 8  # MOVED / ASK / TRYAGAIN / NOSCRIPT answers followed for one call before it fails
# what leaves the slot map in doubt: read it again before the next call
_STALE = (ClusterDownError, RedisConnectionError, RedisTimeoutError, OSError, RuntimeError)


def first_key_slot(body: bytes) -> int:
    """The cluster slot of the first bulk string in `body` (a call's KEYS come first)."""
    end = body.index(b"\r\n")
    return key_slot(body[end + 2 : end + 2 + int(body[1:end])])


class ClusterLines:
    """The hot calls' connections to a cluster's primaries (a `HotLine` each, or TLS: the client's pooled ones), and
    the primary of a slot from the cluster client's map."""

    def __init__(self, client: RedisCluster) -> None:
        self._client = client
        self._map = client.nodes_manager
        self._lean = client.get_connection_kwargs().get("connection_class", Connection) is Connection
        self._lines: dict[str, HotLine] = {}
        self._stale = True  # the map is read before the first call
        self._reading: asyncio.Task[None] | None = None

    async def primary(self, slot: int) -> ClusterNode:
        if self._stale:
            await self._read_map()
        nodes = self._map.slots_cache.get(slot)
        if not nodes:  # not read yet by a client that failed to discover the cluster
            await self._read_map()
            nodes = self._map.slots_cache.get(slot)
            if not nodes:
                raise SlotNotCoveredError(f"slot {slot} is served by no node the cluster names")
        return nodes[0]

    def stale(self) -> None:
        self._stale = True

    async def moved(self, e: MovedError) -> ClusterNode:
        """Patch the map as MOVED says (the client's own rule, which adds a node it did not know) and return the
        slot's new owner."""
        if e.slot_id in self._map.slots_cache:
            await self._map.move_slot(e)
        return self.named(e)

    def named(self, e: AskError) -> ClusterNode:
        """The node a redirection names; one the map does not know yet fails this call and has the map read again."""
        node = self._map.get_node(host=e.host, port=e.port)
        if node is None:
            self._stale = True
            raise ClusterError(f"redirected to {e.host}:{e.port}, a node the slot map does not name yet")
        return node

    async def send(self, node: ClusterNode, packed: bytes, asking: bool = False) -> Any:
        if not self._lean:
            return await self._pooled(node, packed, asking)
        line = self._lines.get(node.name)
        if line is None:
            line = self._lines[node.name] = HotLine(node.connection_kwargs)
        return await (line.call_asking(packed) if asking else line.call(packed))

    async def _pooled(self, node: ClusterNode, packed: bytes, asking: bool) -> Any:
        """One call on a pooled connection of `node` (as HotScript._pooled does on one server)."""
        conn = node.acquire_connection()
        try:
            await conn.send_packed_command(ASKING + packed if asking else packed, check_health=False)
            if asking:
                await conn.read_response()
            return await conn.read_response()
        except (RedisConnectionError, RedisTimeoutError):
            await conn.disconnect()
            raise
        finally:
            node.release(conn)

    async def _read_map(self) -> None:
        """Callers that find the map stale wait on one reading of it (shielded: a cancelled caller does not stop it)."""
        loop = asyncio.get_running_loop()
        task = self._reading
        if task is None or task.done() or task.get_loop() is not loop:
            task = self._reading = loop.create_task(self._read())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if nobody waits
        await asyncio.shield(task)

    async def _read(self) -> None:
        self._stale = False
        try:
            if self._map.slots_cache:
                await self._map.initialize()
            else:
                await self._client.initialize()  # the first call: the client discovers the cluster
        except BaseException:
            self._stale = True
            raise

    def close(self) -> None:
        for line in self._lines.values():
            line.close()
        self._lines.clear()
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None


class ClusterHotScript:
    """`HotScript` on a cluster: `await script.call(n_keys, n_args, body)`, sent to the primary of the first key's
    slot, redirections followed (this module's docstring)."""

    def __init__(self, lines: ClusterLines, script: str) -> None:
        self._lines = lines
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()
        self._head = b"$7\r\nEVALSHA\r\n" + bulk(self.sha)
        self._load = b"*3\r\n" + bulks(("SCRIPT", "LOAD", script))

    async def call(self, n_keys: int, n_args: int, body: bytes) -> Any:
        packed = b"".join((b"*%d\r\n" % (n_keys + n_args + 3), self._head, bulk(n_keys), body))
        lines, slot = self._lines, first_key_slot(body)
        node, asking = await lines.primary(slot), False
        for _ in range(REDIRECTS):
            try:
                return await lines.send(node, packed, asking)
            except MovedError as e:  # (an AskError too: first)
                node, asking = await lines.moved(e), False
            except AskError as e:
                node, asking = lines.named(e), True
            except TryAgainError:
                await asyncio.sleep(0.05)
                node, asking = await lines.primary(slot), False
            except NoScriptError:
                await lines.send(node, self._load)
            except _STALE:
                lines.stale()
                raise
        raise ClusterError(f"slot {slot}: still redirected after {REDIRECTS} tries")
