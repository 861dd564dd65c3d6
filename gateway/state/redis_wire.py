"""The request's two script calls (RESERVE, SETTLE) sent lean: packed once into RESP bytes by the caller
(gateway.state.redis_calls caches what does not change per request, already packed) and sent on a connection of the
client's pool, without redis-py's per-command layers (Script -> evalsha -> execute_command: the retry wrapper, the
observability hooks, packing every argument again through the encoder).

What those layers do for this client is kept, by the same redis-py calls: a connection from the pool
(`get_connection`: waits up to the pool's timeout, hands a connected one) and back to it (`release`), checked first
(`_fresh`: reconnected if Redis closed it while idle or it holds bytes nobody asked for, which the pool itself no
longer checks while redis-py's maintenance notifications are on, their default); `send_packed_command` /
`read_response` with the connection's socket timeout, which disconnect the connection on any failure or cancellation
mid-call (so it is never reused half read); a ConnectionError or TimeoutError disconnects it too, as execute_command
does (its retry makes no retries here: a connection from a URL-built pool has none); NOSCRIPT (Redis lost its
scripts: a restart, SCRIPT FLUSH, a failover) loads the script and sends the call once more, as `Script.__call__`
does. Replies are read by the connection's own parser, decoded as the pool says (decode_responses). EVALSHA has no
response callback, so the reply is what `Script.__call__` returned.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError


def bulk(value: Any) -> bytes:
    """One argument as a RESP bulk string, encoded as redis-py's Encoder encodes it (bytes as they are, int and float
    by repr, str as UTF-8; bool and anything else refused)."""
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        data = repr(value).encode()
    else:
        raise DataError(
            f"Invalid input of type: '{type(value).__name__}'. Convert to a bytes, string, int or float first."
        )
    return b"$%d\r\n%s\r\n" % (len(data), data)


def bulks(values: Iterable[Any]) -> bytes:
    return b"".join(map(bulk, values))


async def _fresh(conn: Any) -> None:
    """Reconnect a pooled connection that Redis closed while it was idle (a restart, a failover) or that holds bytes
    nobody asked for: the pool's own check is skipped while redis-py's maintenance notifications are on (their
    default). Without it, the first call after a Redis restart could go out on a dead socket and fail."""
    try:
        stale = await conn.can_read()
    except (RedisConnectionError, RedisTimeoutError, OSError):
        stale = True
    if stale:
        await conn.disconnect()
        await conn.connect()


class HotScript:
    """One registered script, called lean: `await script.call(n_keys, n_args, body)` where `body` is its KEYS then its
    ARGV as bulk strings (`bulk`, or parts cached already packed). Raises what the client's call would (a
    redis.RedisError, an OSError, ...); `sha` as `register_script` computes it."""

    def __init__(self, client: aioredis.Redis, script: str) -> None:
        self._client = client
        self._pool = client.connection_pool
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()
        self._head = self._evalsha_head()

    def _evalsha_head(self) -> bytes:
        return b"$7\r\nEVALSHA\r\n" + bulk(self.sha)

    async def call(self, n_keys: int, n_args: int, body: bytes) -> Any:
        """EVALSHA sha n_keys KEYS... ARGV...: one round trip (two after a NOSCRIPT)."""
        array = b"*%d\r\n" % (n_keys + n_args + 3)
        numkeys = bulk(n_keys)
        try:
            return await self._send(b"".join((array, self._head, numkeys, body)))
        except NoScriptError:
            self.sha = await self._client.script_load(self.script)
            self._head = self._evalsha_head()
            return await self._send(b"".join((array, self._head, numkeys, body)))

    async def _send(self, packed: bytes) -> Any:
        pool = self._pool
        conn = await pool.get_connection()
        try:
            await _fresh(conn)
            await conn.send_packed_command(packed, check_health=False)
            return await conn.read_response()
        except (RedisConnectionError, RedisTimeoutError):
            # execute_command's retry wrapper, with no retries: the connection is dropped, the error raised
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)
