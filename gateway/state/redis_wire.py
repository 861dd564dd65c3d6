"""The request's two script calls (RESERVE, SETTLE) sent lean: packed once into RESP bytes by the caller
(gateway.state.redis_calls caches what does not change per request, already packed) and sent on a connection of
their own (`HotLine`), pipelined: each call is written as it comes and its reply, parsed by hiredis, handed back in
the order Redis answers, which is the order of the calls. No pool checkout, lock, per-call timeout task or
observability hook per call: the layers redis-py puts around a command cost more CPU than the round trip.

What those layers did for these calls is kept: the connection is made from the pool's own settings (host and port
or unix socket, username and password, db, client name, connect and socket timeouts) and remade on the next call
after Redis closed it, a reply that does not come within the socket timeout drops the connection and fails every
call waiting on it (a late reply can never be matched to the wrong caller), a caller that stops waiting
(cancelled) leaves its place in line so its reply is read and dropped, Redis's error replies become redis-py's
exceptions (its own error-code table), and NOSCRIPT (Redis lost its scripts: a restart, SCRIPT FLUSH, a failover)
loads the script and sends the call once more, as `Script.__call__` does. A TLS URL (rediss://) keeps redis-py's
pooled connections for these calls (`HotScript` without a line): checked out and back in, read by the connection's
parser, disconnected on a ConnectionError or TimeoutError as execute_command does (its retry makes no retries here).
On a Redis Cluster the same lines carry these calls, one per primary (gateway.state.redis_cluster_wire).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.asyncio.connection import Connection, ConnectionPool, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

# the clients RedisState runs on: one server's, or a cluster's
RedisClient = aioredis.Redis | aioredis.RedisCluster


def bulk(value: Any) -> bytes:
    """One argument as a RESP bulk string, encoded as redis-py's Encoder encodes it (bytes as they are, int and float
    by repr, str as UTF-8; bool and anything else refused). The exact types first: a dozen of these per call."""
    kind = type(value)
    if kind is str:
        data = value.encode()
    elif kind is int:
        data = b"%d" % value  # repr of an int
    elif kind is bytes:
        data = value
    elif kind is float:
        data = repr(value).encode()
    elif isinstance(value, bytes):
        data = bytes(value)
    elif isinstance(value, str):
        data = str(value).encode()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        data = repr(value).encode()
    else:
        raise DataError(
            f"Invalid input of type: '{type(value).__name__}'. Convert to a bytes, string, int or float first."
        )
    return b"$%d\r\n%s\r\n" % (len(data), data)


def bulks(values: Iterable[Any]) -> bytes:
    return b"".join(map(bulk, values))


ASKING = b"*1\r\n$6\r\nASKING\r\n"


class _Wire(asyncio.Protocol):
    """One connection's bytes: calls written as they come, replies (parsed by hiredis) handed to their callers in
    the order the calls were sent, which is the order Redis answers them. A caller that stopped waiting (cancelled,
    timed out) leaves its place in line, so its late reply is read and dropped, never taken for the next one's."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float | None) -> None:
        self.loop, self.timeout_s = loop, timeout_s
        self.reader = hiredis.Reader(encoding="utf-8", replyError=ResponseError)
        self.waiting: deque[tuple[float, asyncio.Future]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def send(self, packed: bytes) -> asyncio.Future:
        """Write one call; the future is its reply (or the error that ended the connection)."""
        assert self.transport is not None
        reply = self.loop.create_future()
        if self.lost is not None:
            reply.set_exception(self.lost)
            return reply
        self.transport.write(packed)
        deadline = math.inf if self.timeout_s is None else self.loop.time() + self.timeout_s
        self.waiting.append((deadline, reply))
        if self._timer is None and self.timeout_s is not None:
            self._timer = self.loop.call_at(deadline, self._check_deadline)
        return reply

    def close(self) -> None:
        if self.transport is not None and self.lost is None:
            self._abort(RedisConnectionError("Connection closed by the gateway"))

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as e:
                self._abort(RedisConnectionError(f"Protocol error from Redis: {e}"))
                return
            if reply is False:
                return
            if not self.waiting:
                self._abort(RedisConnectionError("Redis sent a reply nobody asked for"))
                return
            _, future = self.waiting.popleft()
            if not future.done():
                if isinstance(reply, ResponseError):
                    future.set_exception(BaseParser.parse_error(str(reply)))
                else:
                    future.set_result(reply)

    def _check_deadline(self) -> None:
        """One timer per connection, not one per call: it wakes at the oldest call's deadline and, if that call is
        still unanswered, drops the connection (every call on it fails: their replies can no longer be matched)."""
        self._timer = None
        if not self.waiting or self.lost is not None:
            return
        deadline = self.waiting[0][0]
        if self.loop.time() >= deadline:
            self._abort(RedisTimeoutError("Timeout reading from Redis"))
        else:
            self._timer = self.loop.call_at(deadline, self._check_deadline)

    def _abort(self, error: Exception) -> None:
        if self.lost is None:
            self.lost = error
        if self.transport is not None:
            self.transport.abort()
        self._fail_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = RedisConnectionError(f"Connection closed by Redis{f': {exc}' if exc else ''}")
        self._fail_waiting()

    def _fail_waiting(self) -> None:
        assert self.lost is not None
        while self.waiting:
            _, future = self.waiting.popleft()
            if not future.done():
                future.set_exception(type(self.lost)(*self.lost.args))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class HotLine:
    """The hot scripts' own connection to Redis, made from a pool's settings (its connection_kwargs; on a cluster, a
    primary's: gateway.state.redis_cluster_wire), opened on first use and remade on the next call after it was
    lost. One connection carries every hot call of this process (on a cluster, to that primary), pipelined (Redis
    runs scripts one at a time anyway); it belongs to the event loop that opened it, and a call from another loop
    opens another."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self._settings = settings  # a pool's (or a cluster node's) connection_kwargs
        self._wire: _Wire | None = None
        self._opening: asyncio.Task[_Wire] | None = None

    @staticmethod
    def serves(pool: ConnectionPool) -> bool:
        """Plain TCP and unix sockets; TLS stays on redis-py's connections."""
        return pool.connection_class in (Connection, UnixDomainSocketConnection)

    async def call(self, packed: bytes) -> Any:
        wire = self._wire
        if wire is None or wire.lost is not None or wire.loop is not asyncio.get_running_loop():
            wire = await self._open()
        return await wire.send(packed)

    async def call_asking(self, packed: bytes) -> Any:
        """ASKING, then the call, back to back on this line (a cluster's ASK redirection: the slot is being migrated
        here); the call's reply."""
        wire = self._wire
        if wire is None or wire.lost is not None or wire.loop is not asyncio.get_running_loop():
            wire = await self._open()
        return (await asyncio.gather(wire.send(ASKING), wire.send(packed)))[1]

    async def _open(self) -> _Wire:
        """Callers that find no connection wait on one opening (shielded: a cancelled caller does not abort it)."""
        loop = asyncio.get_running_loop()
        task = self._opening
        if task is None or task.done() or task.get_loop() is not loop:
            task = self._opening = loop.create_task(self._connect())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if nobody waits
        return await asyncio.shield(task)

    async def _connect(self) -> _Wire:
        settings = self._settings
        loop = asyncio.get_running_loop()
        wire = _Wire(loop, settings.get("socket_timeout"))
        try:
            async with asyncio.timeout(settings.get("socket_connect_timeout") or settings.get("socket_timeout")):
                if "path" in settings:
                    await loop.create_unix_connection(lambda: wire, settings["path"])
                else:
                    host, port = settings.get("host", "localhost"), settings.get("port", 6379)
                    await loop.create_connection(lambda: wire, host, port)
                for command in self._handshake():
                    await wire.send(command)
        except BaseException:
            wire.close()
            raise
        old, self._wire = self._wire, wire
        if old is not None and old.loop is loop:
            old.close()
        return wire

    def _handshake(self) -> list[bytes]:
        """What redis-py's Connection.on_connect sends for these settings (RESP2, whose script replies are the
        same as RESP3's: scripts return arrays, integers, strings and nil)."""
        settings, commands = self._settings, []
        if settings.get("password"):
            auth = [settings["username"]] if settings.get("username") else []
            commands.append(("AUTH", *auth, settings["password"]))
        if settings.get("client_name"):
            commands.append(("CLIENT", "SETNAME", settings["client_name"]))
        if settings.get("db"):
            commands.append(("SELECT", settings["db"]))
        return [b"*%d\r\n%s" % (len(c), bulks(c)) for c in commands]

    def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
            self._wire = None
        if self._opening is not None:
            self._opening.cancel()
            self._opening = None


class HotScript:
    """One registered script, called lean: `await script.call(n_keys, n_args, body)` where `body` is its KEYS then its
    ARGV as bulk strings (`bulk`, or parts cached already packed). Sent on `line`, or without one (TLS) on a pooled
    connection of `client`. Raises what the client's call would (a redis.RedisError, an OSError, ...); `sha` as
    `register_script` computes it."""

    def __init__(self, client: aioredis.Redis, script: str, line: HotLine | None = None) -> None:
        self._client = client
        self._pool = client.connection_pool
        self._line = line
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()
        self._head = self._evalsha_head()

    def _evalsha_head(self) -> bytes:
        return b"$7\r\nEVALSHA\r\n" + bulk(self.sha)

    async def call(self, n_keys: int, n_args: int, body: bytes) -> Any:
        """EVALSHA sha n_keys KEYS... ARGV...: one round trip (two after a NOSCRIPT)."""
        array = b"*%d\r\n" % (n_keys + n_args + 3)
        numkeys = bulk(n_keys)
        send = self._pooled if self._line is None else self._line.call
        try:
            return await send(b"".join((array, self._head, numkeys, body)))
        except NoScriptError:
            self.sha = await self._client.script_load(self.script)
            self._head = self._evalsha_head()
            return await send(b"".join((array, self._head, numkeys, body)))

    async def _pooled(self, packed: bytes) -> Any:
        pool = self._pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(packed, check_health=False)
            return await conn.read_response()
        except (RedisConnectionError, RedisTimeoutError):
            # execute_command's retry wrapper, with no retries: the connection is dropped, the error raised
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)
