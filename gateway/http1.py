"""A small keep-alive HTTP/1.1 client for the upstream hot path.

Why not httpx here: on this path it cost ~0.7 ms of CPU per request (request/response models, cookie jar,
anyio, h11), more than everything else the gateway does. Upstreams are OpenAI-compatible servers answering
JSON or SSE over HTTP/1.1, so the client needs little: one write per request, Content-Length or chunked
bodies, connection reuse. ~15x less CPU per call (see loadtests/bench_gateway.py).
A connection goes back to the pool only after its response was read to the end; one cut short (timeout,
client gone) is closed, so a half-read body can never leak into the next request.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HTTPError(Exception):
    """Connection refused or reset, or a malformed response."""


class _Conn:
    __slots__ = ("reader", "writer", "key", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: tuple) -> None:
        self.reader, self.writer, self.key = reader, writer, key
        self.idle_since = 0.0

    def close(self) -> None:
        self.writer.close()


class Response:
    """Status and headers are read; the body is read with `read()` or `aiter_raw()`, then `aclose()`."""

    def __init__(self, pool: HTTP1Pool, conn: _Conn, status: int, headers: dict[bytes, bytes]) -> None:
        self._pool, self._conn = pool, conn
        self.status_code, self.headers = status, headers
        self._done = False
        te = headers.get(b"transfer-encoding", b"").lower()
        self._chunked = b"chunked" in te
        length = headers.get(b"content-length")
        self._length = int(length) if length is not None and not self._chunked else None
        self._keep_alive = headers.get(b"connection", b"").lower() != b"close" and (
            self._chunked or self._length is not None
        )

    async def read(self) -> bytes:
        return b"".join([part async for part in self.aiter_raw()])

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        reader = self._conn.reader
        try:
            if self._chunked:
                while True:
                    line = await reader.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0], 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, if any
                            pass
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self._length is not None:
                left = self._length
                while left:
                    data = await reader.read(min(left, 65536))
                    if not data:
                        raise HTTPError("connection closed mid-body")
                    left -= len(data)
                    yield data
            else:  # no framing: the body runs to the end of the connection
                while data := await reader.read(65536):
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ConnectionError) as e:
            raise HTTPError(f"bad response body: {type(e).__name__}") from e
        self._done = True

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep_alive:
            self._pool._release(conn)
        else:
            conn.close()


class HTTP1Pool:
    def __init__(self, connect_timeout_s: float = 5.0, keepalive_s: float = 4.0, max_idle_per_host: int = 256):
        # keepalive_s stays under uvicorn's default 5 s server-side idle timeout: never reuse a socket the
        # server is about to close.
        self.connect_timeout_s, self.keepalive_s, self.max_idle = connect_timeout_s, keepalive_s, max_idle_per_host
        self._idle: dict[tuple, list[_Conn]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def request(self, method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None):
        """Send a request and read the status line and headers. A reused connection that turns out to be
        closed by the server before answering is retried once on a fresh one (nothing was processed)."""
        parts = urlsplit(url)
        scheme, host = parts.scheme, parts.hostname or "127.0.0.1"
        port = parts.port or (443 if scheme == "https" else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"{method} {target} HTTP/1.1", f"host: {parts.netloc}", f"content-length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        payload = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        key = (scheme, host, port)
        for attempt in range(2):
            conn, reused = await self._acquire(key)
            try:
                conn.writer.write(payload)
                head = await conn.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                conn.close()
                if reused and attempt == 0 and not getattr(e, "partial", b""):
                    continue
                raise HTTPError(f"{host}:{port}: {type(e).__name__}") from e
            except asyncio.LimitOverrunError as e:
                conn.close()
                raise HTTPError(f"{host}:{port}: response headers too large") from e
            except BaseException:
                conn.close()  # cancelled or timed out mid-request: the socket's state is unknown
                raise
            return _parse_head(self, conn, head)
        raise AssertionError("unreachable")

    async def _acquire(self, key: tuple) -> tuple[_Conn, bool]:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < self.keepalive_s and not conn.writer.is_closing() and not conn.reader.at_eof():
                return conn, True
            conn.close()
        scheme, host, port = key
        if scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=self._ssl if scheme == "https" else None, limit=1 << 20
                )
        except (OSError, TimeoutError) as e:
            raise HTTPError(f"cannot connect to {host}:{port}: {type(e).__name__}: {e}") from e
        return _Conn(reader, writer, key), False

    def _release(self, conn: _Conn) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle or conn.writer.is_closing():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _parse_head(pool: HTTP1Pool, conn: _Conn, head: bytes) -> Response:
    lines = head.split(b"\r\n")
    status_line = lines[0].split(b" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1.") or not status_line[1].isdigit():
        conn.close()
        raise HTTPError(f"not an HTTP/1.x response: {lines[0][:60]!r}")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
    return Response(pool, conn, int(status_line[1]), headers)
