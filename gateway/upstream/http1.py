"""A small keep-alive HTTP/1.1 client for the upstream hot path.

Why not httpx here: on this path it cost ~0.7 ms of CPU per request (request/response models, cookie jar,
anyio, h11), more than everything else the gateway does. Upstreams are OpenAI-compatible servers answering
JSON or SSE over HTTP/1.1, so the client needs little: one write per request, Content-Length or chunked
bodies, connection reuse. ~15x less CPU per call (see loadtests/bench_gateway.py).

A connection goes back to the pool only after its response was read to the end; one cut short (timeout,
client gone) is closed, so a half-read body can never leak into the next request. Interim 1xx responses
(100 Continue, 103 Early Hints) are skipped; 204, 304 and any answer to HEAD have no body.

Retries: a request is never sent twice when it may have reached the upstream (a duplicate generation would
be billed once). A pooled socket found dead before anything is written (closed, reset, at EOF, or holding
bytes nobody asked for, such as a 408 sent before an idle close) is dropped and another one taken: nothing
was sent. Once written, a request whose reused connection closes before any response byte is retried once
on a fresh connection only if its method is idempotent (GET, HEAD, OPTIONS); anything else (POST) raises
HTTPError ("... not retried because the request may have been processed"). Stale pooled sockets are kept
rare instead: keepalive_s stays under the servers' idle timeout and the checks above cost no syscall (the
event loop has already fed each idle socket's reader whatever arrived on it).

Proxies (trust_env, the default): HTTP_PROXY / HTTPS_PROXY / NO_PROXY, either case, read once when the pool
is made, as urllib.request.getproxies() and proxy_bypass_environment() read them. An http:// target goes
through the proxy with an absolute-form request target; an https:// one through a CONNECT tunnel with TLS
to the target inside. Only http:// proxies are supported; user:pass in the proxy URL is sent as Basic
Proxy-Authorization. Connections are pooled per (target, proxy).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
import urllib.request
from collections.abc import AsyncIterator
from urllib.parse import SplitResult, unquote, urlsplit

import orjson

_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})
_LIMIT = 1 << 20  # the longest response head (and chunk-size line) we read


class HTTPError(Exception):
    """Connection refused or reset, or a malformed response."""


class _Conn:
    __slots__ = ("reader", "writer", "key", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: tuple) -> None:
        self.reader, self.writer, self.key = reader, writer, key
        self.idle_since = 0.0

    def alive(self) -> bool:
        """No syscall: closed, reset, EOF seen, or unsolicited bytes waiting mean the socket is done."""
        reader = self.reader
        return (
            not self.writer.is_closing()
            and not reader.at_eof()
            and reader.exception() is None
            # asyncio.StreamReader's buffer (private: not in its stubs); no public way to ask if it holds bytes
            and not reader._buffer  # type: ignore[attr-defined]
        )

    def close(self) -> None:
        self.writer.close()


class _Route:
    """Where one scheme://netloc goes: pool key, Host header, and the proxy (host, port, authorization)."""

    __slots__ = ("key", "host", "port", "tls", "connect_to", "head", "proxy")

    def __init__(self, scheme: str, host: str, port: int, netloc: str, proxy: tuple | None) -> None:
        self.host, self.port, self.tls, self.proxy = host, port, scheme == "https", proxy
        self.key = (scheme, host, port, proxy)
        self.connect_to = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # the CONNECT target
        authority = netloc.rpartition("@")[2]  # never send URL credentials in Host
        if proxy is not None and not self.tls:  # forwarded: absolute-form target, proxy credentials each time
            auth = f"\r\nproxy-authorization: {proxy[2]}" if proxy[2] else ""
            self.head = (f"http://{authority}", f" HTTP/1.1\r\nhost: {authority}{auth}")
        else:
            self.head = ("", f" HTTP/1.1\r\nhost: {authority}")


class Response:
    """Status and headers are read; the body is read with `read()` or `aiter_raw()`, then `aclose()`."""

    def __init__(
        self,
        pool: HTTP1Pool,
        conn: _Conn,
        status: int,
        headers: dict[bytes, bytes],
        no_body: bool = False,
        http10: bool = False,
    ) -> None:
        self._pool = pool
        self._conn: _Conn | None = conn  # None once closed
        self.status_code, self.headers = status, headers
        self._chunked = False
        if no_body or status == 204 or status == 304:
            self._length: int | None = 0
        elif (te := headers.get(b"transfer-encoding")) is not None:
            # chunked must come last; any other coding runs to the end of the connection
            self._chunked = te.rsplit(b",", 1)[-1].strip().lower() == b"chunked"
            self._length = None
        elif (length := headers.get(b"content-length")) is not None:
            self._length = _content_length(length)
        else:
            self._length = None  # no framing: the body runs to the end of the connection
        self._done = self._length == 0
        persistent = not http10
        if (connection := headers.get(b"connection")) is not None:
            tokens = {t.strip() for t in connection.lower().split(b",")}
            persistent = b"close" not in tokens and (not http10 or b"keep-alive" in tokens)
        self._keep_alive = persistent and (self._chunked or self._length is not None)

    async def read(self) -> bytes:
        return b"".join([part async for part in self.aiter_raw()])

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        if self._done or self._conn is None:
            return
        reader = self._conn.reader
        try:
            if self._chunked:
                while True:
                    line = await reader.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0], 16)
                    if size <= 0:
                        if size < 0:
                            raise ValueError("negative chunk size")
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
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError) as e:
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
    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        keepalive_s: float = 4.0,
        max_idle_per_host: int = 256,
        trust_env: bool = True,
        ssl_context: ssl.SSLContext | None = None,
    ):
        # keepalive_s stays under uvicorn's default 5 s server-side idle timeout: never reuse a socket the
        # server is about to close.
        self.connect_timeout_s, self.keepalive_s, self.max_idle = connect_timeout_s, keepalive_s, max_idle_per_host
        self._idle: dict[tuple, list[_Conn]] = {}
        self._ssl = ssl_context
        self._proxies = urllib.request.getproxies() if trust_env else {}
        self._routes: dict[tuple[str, str], _Route] = {}
        self._next_sweep = 0.0
        self._closed = False

    async def request(
        self, method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> Response:
        """Send a request and read the status line and headers (see the module docstring on retries)."""
        parts = urlsplit(url)
        route = self._routes.get((parts.scheme, parts.netloc)) or self._route(parts)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        idempotent = method in _IDEMPOTENT
        lines = [method + " " + route.head[0] + target + route.head[1]]
        if body or not idempotent:
            lines.append(f"content-length: {len(body)}")
        if headers:
            lines += [f"{k}: {v}" for k, v in headers.items()]
        payload = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        fresh = False
        while True:
            conn, reused = await self._acquire(route, fresh)
            answered = False
            try:
                conn.writer.write(payload)
                while True:
                    head = await conn.reader.readuntil(b"\r\n\r\n")
                    answered = True
                    status, http10, hdrs = _parse_head(head)
                    if status >= 200:
                        return Response(self, conn, status, hdrs, method == "HEAD", http10)
                    if status == 101:
                        raise HTTPError(f"{route.connect_to}: unexpected 101 Switching Protocols")
                    # 1xx interim (100 Continue, 103 Early Hints): the final response follows
            except HTTPError:
                conn.close()
                raise
            except (asyncio.IncompleteReadError, OSError) as e:
                conn.close()
                if answered or (isinstance(e, asyncio.IncompleteReadError) and e.partial):
                    raise HTTPError(f"{route.connect_to}: connection closed mid-response: {type(e).__name__}") from e
                if reused and not fresh and idempotent:
                    fresh = True  # the server dropped a kept-alive socket; a GET can safely go again
                    continue
                why = "; not retried because the request may have been processed" if not idempotent else ""
                raise HTTPError(
                    f"{route.connect_to}: connection closed before a response ({type(e).__name__}){why}"
                ) from e
            except asyncio.LimitOverrunError as e:
                conn.close()
                raise HTTPError(f"{route.connect_to}: response headers too large") from e
            except BaseException:
                conn.close()  # cancelled or timed out mid-request: the socket's state is unknown
                raise

    def _route(self, parts: SplitResult) -> _Route:
        scheme = parts.scheme
        if scheme not in ("http", "https"):
            raise HTTPError(f"unsupported URL scheme: {scheme!r}")
        try:
            host, port = parts.hostname or "127.0.0.1", parts.port or (443 if scheme == "https" else 80)
        except ValueError as e:
            raise HTTPError(f"bad URL authority {parts.netloc!r}: {e}") from e
        route = _Route(scheme, host, port, parts.netloc, self._proxy_for(scheme, parts.netloc.rpartition("@")[2]))
        if len(self._routes) >= 1024:  # upstream URLs come from config; this only bounds a misuse
            self._routes.clear()
        self._routes[(scheme, parts.netloc)] = route
        return route

    def _proxy_for(self, scheme: str, authority: str) -> tuple[str, int, str | None] | None:
        """(host, port, Proxy-Authorization value) of the proxy for this target, or None to go direct."""
        url = self._proxies.get(scheme)
        # proxy_bypass_environment: in urllib.request but not its __all__, so absent from its stubs
        if not url or urllib.request.proxy_bypass_environment(authority, self._proxies):  # type: ignore[attr-defined]
            return None
        p = urlsplit(url if "://" in url else "http://" + url)
        if p.scheme != "http":
            raise HTTPError(f"proxy {p.scheme}://{p.hostname}: only http:// proxies are supported")
        try:
            port = p.port or 80
        except ValueError as e:
            raise HTTPError(f"bad proxy URL port: {e}") from e
        auth = None
        if p.username is not None:
            userpass = f"{unquote(p.username)}:{unquote(p.password or '')}".encode()
            auth = "Basic " + base64.b64encode(userpass).decode("ascii")
        return p.hostname or "127.0.0.1", port, auth

    async def _acquire(self, route: _Route, fresh: bool = False) -> tuple[_Conn, bool]:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._sweep(now)
        if not fresh:
            idle = self._idle.get(route.key)
            while idle:
                conn = idle.pop()
                if now - conn.idle_since < self.keepalive_s and conn.alive():
                    return conn, True
                conn.close()  # found dead before anything was written: take another, nothing to retry
        return await self._connect(route), False

    async def _connect(self, route: _Route) -> _Conn:
        ctx = None
        if route.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ctx = self._ssl
        proxy = route.proxy
        where = route.connect_to + (f" via proxy {proxy[0]}:{proxy[1]}" if proxy else "")
        try:
            async with asyncio.timeout(self.connect_timeout_s):  # covers the proxy's CONNECT and TLS too
                if proxy is None:
                    reader, writer = await asyncio.open_connection(route.host, route.port, ssl=ctx, limit=_LIMIT)
                else:
                    reader, writer = await asyncio.open_connection(proxy[0], proxy[1], limit=_LIMIT)
                    if ctx is not None:
                        try:
                            await _tunnel(route, reader, writer, ctx)
                        except BaseException:
                            writer.close()
                            raise
        except (OSError, TimeoutError) as e:
            raise HTTPError(f"cannot connect to {where}: {type(e).__name__}: {e}") from e
        return _Conn(reader, writer, route.key)

    def _release(self, conn: _Conn) -> None:
        # not alive here: the server closed, or sent more than the response framing said (garbage ahead)
        if self._closed or not conn.alive():
            conn.close()
            return
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def _sweep(self, now: float) -> None:
        """Close idle sockets past keepalive_s or closed by the server, every keepalive_s: under steady traffic
        LIFO reuse never reaches the oldest ones, and a host no longer called would keep them open."""
        self._next_sweep = now + self.keepalive_s
        for key, idle in list(self._idle.items()):
            keep = []
            for conn in idle:
                if now - conn.idle_since < self.keepalive_s and conn.alive():
                    keep.append(conn)
                else:
                    conn.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    async def aclose(self) -> None:
        """Close the idle sockets; responses still open close theirs at their aclose (never pooled again)."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


async def request_json(
    client: HTTP1Pool, method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None, timeout_s=2.0
):
    """The decoded JSON of a 200 answer, read to the end within `timeout_s`; None for any other answer, a failure
    or a timeout (for control calls whose answer is advisory: /load, /v1/models, /abort)."""
    try:
        async with asyncio.timeout(timeout_s):
            r = await client.request(method, url, body, headers)
            try:
                raw = await r.read()
            finally:
                await r.aclose()
        return orjson.loads(raw) if r.status_code == 200 else None
    except (HTTPError, TimeoutError, orjson.JSONDecodeError):
        return None


async def _tunnel(route: _Route, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ctx) -> None:
    """CONNECT through the proxy, require a 2xx, then TLS to the target inside the tunnel."""
    assert route.proxy is not None  # a tunnel only for a route through a proxy
    auth = f"proxy-authorization: {route.proxy[2]}\r\n" if route.proxy[2] else ""
    writer.write(f"CONNECT {route.connect_to} HTTP/1.1\r\nhost: {route.connect_to}\r\n{auth}\r\n".encode("latin-1"))
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        raise HTTPError(f"proxy closed or garbled its answer to CONNECT {route.connect_to}") from e
    status, _, _ = _parse_head(head)
    if not 200 <= status < 300:
        status_line = head.split(b"\r\n", 1)[0][:80]
        raise HTTPError(f"proxy refused CONNECT {route.connect_to}: {status_line!r}")
    await writer.start_tls(ctx, server_hostname=route.host)


def _parse_head(head: bytes) -> tuple[int, bool, dict[bytes, bytes]]:
    """(status, is HTTP/1.0, headers with lowercased names; repeated ones joined with ', ')."""
    lines = head.split(b"\r\n")
    status_line = lines[0].split(b" ", 2)
    if (
        len(status_line) < 2
        or not status_line[0].startswith(b"HTTP/1.")
        or len(status_line[1]) != 3
        or not status_line[1].isdigit()
    ):
        raise HTTPError(f"not an HTTP/1.x response: {lines[0][:60]!r}")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip()
            headers[name] = headers[name] + b", " + value if name in headers else value
    return int(status_line[1]), status_line[0] == b"HTTP/1.0", headers


def _content_length(value: bytes) -> int:
    if value.isdigit():
        return int(value)
    values = {v.strip() for v in value.split(b",")}  # repeated header lines, joined: all must agree
    if len(values) == 1 and (only := values.pop()).isdigit():
        return int(only)
    raise HTTPError(f"bad content-length: {value[:40]!r}")
