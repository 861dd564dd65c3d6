"""The upstream HTTP client: aiohttp's (a C parser, llhttp) behind the small surface the gateway calls.

Why aiohttp: a hand-written HTTP/1.1 client was lean but left the gateway owning a parser, framing rules and a pool;
httpx costs more CPU per call than the rest of the gateway on this path (request/response models, anyio, h11).
aiohttp parses in C, pools per upstream host and is well kept (loadtests/bench_http_client.py compares them).
Why not its `trust_env`: aiohttp then looks up proxies and ~/.netrc per request on a thread; proxies are read
here once instead.

What it guarantees (tested on real sockets: tests/unit/gateway/test_upstream_client*.py,
tests/app/gateway/test_app_upstream_client.py and, through the gateway, test_app_upstream_malformed.py):
- A POST is never sent twice. aiohttp retries a request once after its connection closed before an answer only
  for idempotent methods (GET, HEAD, OPTIONS, TRACE, PUT, DELETE: `_IDEMPOTENT`); anything
  else raises HTTPError ("... not retried because the request may have been processed").
- A connection goes back to the pool only once its response was received to the end (aiohttp hands it back then;
  an unread rest waits in the response, never on the socket); one cut short (cancelled, timed out, client gone,
  malformed) is closed. A pooled socket holding bytes nobody asked for (a 408 sent before an idle close) is
  dropped before anything is written to it (`_Connector`): they are never read as the next answer. Bytes past a
  response's framing fail that response (llhttp reads them as the next status line) and close the socket.
- Interim 1xx answers are skipped; 204, 304 and answers to HEAD have no body; redirects are not followed.
- Malformed answers (bad chunk sizes, oversized or too many headers, bad Content-Length, a body cut short, a body
  `read` whole past MAX_BODY_BYTES) and refused or reset connections raise HTTPError, never a hang.
- Proxies (trust_env, the default): HTTP_PROXY / HTTPS_PROXY / NO_PROXY, either case, read once when the client is
  made as urllib.request reads them. An http:// target goes through the proxy in absolute form, an https:// one
  through a CONNECT tunnel with TLS to the target inside. Only http:// proxies; user:pass in the proxy URL is sent
  as Basic Proxy-Authorization. Connections are pooled per (target, proxy).
- Idle sockets are closed after keepalive_s, under the servers' idle timeout (uvicorn's default is 5 s), so that
  a socket the server is about to close is not reused. No cookie jar, no decompression (bodies are relayed as
  they came; Accept-Encoding is not sent), no default headers beyond Host and Content-Length.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import urllib.request
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

import aiohttp
import orjson
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

# The methods aiohttp replays once on a fresh connection when a kept-alive one closed before an answer
# (aiohttp.client.IDEMPOTENT_METHODS, since 3.9; RFC 9112 9.3.1): the others are never sent twice.
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
# Headers aiohttp would add on its own that an upstream does not need (and Accept-Encoding would ask for bodies
# this client does not decompress).
_SKIP_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
# A pooled connection is dropped, not reused, when it holds unsolicited bytes; past this many in a row the next one
# is used anyway (a fresh connection never holds any: this only bounds a pathological server).
_MAX_DROPPED = 32
_FAILURES = (aiohttp.ClientError, HttpProcessingError, OSError)
# Reading a body whose socket the client's aclose() closed raises aiohttp's RuntimeError("Connection closed.").
_BODY_FAILURES = (*_FAILURES, RuntimeError)
# The longest body `Response.read` takes (a non-stream answer, an error body, a control call's JSON): what an upstream
# that never stops sending can cost in memory. Text alone stays far below it (millions of tokens); with top-20
# logprobs on every token (about 1.2 KB each) an answer reaches it past ~50k tokens in all choices together, which is
# what a stream is for. A stream is read event by event, each with its own bound (gateway/upstream/sse.py).
MAX_BODY_BYTES = 64 << 20


class HTTPError(Exception):
    """Connection refused or reset, a malformed response, or a body cut short."""


class _Connector(aiohttp.TCPConnector):
    """aiohttp's pool, minus sockets that received bytes while idle (an answer nobody asked for)."""

    async def connect(self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout) -> Any:
        for _ in range(_MAX_DROPPED):
            conn = await super().connect(req, traces, timeout)
            if conn.protocol is None or not conn.protocol.should_close:
                return conn
            conn.close()  # nothing was written to it yet: taking another one is always safe
        return await super().connect(req, traces, timeout)


class _Route:
    """One URL as aiohttp takes it (parsed once) and where it goes: its proxy, and what that proxy is told."""

    __slots__ = ("url", "where", "proxy", "proxy_headers", "extra_headers")

    def __init__(self, url: str, proxy: tuple[str, int, str | None] | None) -> None:
        self.url = URL(url)
        self.where = f"{self.url.host}:{self.url.port}"
        self.proxy: URL | None = None
        self.proxy_headers: dict[str, str] | None = None
        self.extra_headers: dict[str, str] | None = None
        if proxy is not None:
            host, port, auth = proxy
            self.proxy = URL.build(scheme="http", host=host, port=port)
            self.where += f" via proxy {host}:{port}"
            if auth is not None:
                if self.url.scheme == "https":
                    self.proxy_headers = {"Proxy-Authorization": auth}  # on the CONNECT only
                else:
                    self.extra_headers = {"Proxy-Authorization": auth}  # forwarded: on every request


class Response:
    """Status and headers are read; the body is read with `read()` or `aiter_raw()`, then `aclose()`.
    `headers`: aiohttp's case-insensitive mapping of str names to str values."""

    __slots__ = ("_resp", "_where", "status_code", "headers")

    def __init__(self, resp: aiohttp.ClientResponse, where: str) -> None:
        self._resp, self._where = resp, where
        self.status_code = resp.status
        self.headers = resp.headers

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; HTTPError past `max_bytes` (default MAX_BODY_BYTES), as soon as it says or reads more."""
        limit = MAX_BODY_BYTES if max_bytes is None else max_bytes
        length = self._resp.content_length
        if length is not None and length > limit:
            raise HTTPError(f"{self._where}: a response body of {length} bytes, over the bound of {limit}")
        content, body = self._resp.content, bytearray()
        try:
            while data := await content.readany():
                body += data
                if len(body) > limit:
                    raise HTTPError(f"{self._where}: a response body over the bound of {limit} bytes")
        except _BODY_FAILURES as e:
            raise HTTPError(f"{self._where}: bad response body: {type(e).__name__}: {e}") from e
        return bytes(body)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked framing removed, nothing decoded)."""
        content = self._resp.content
        try:
            while data := await content.readany():
                yield data
        except _BODY_FAILURES as e:
            raise HTTPError(f"{self._where}: bad response body: {type(e).__name__}: {e}") from e

    async def aclose(self) -> None:
        resp = self._resp
        if resp.content.is_eof() and resp.content.exception() is None:
            resp.release()  # complete: the socket goes back to the pool (if the server keeps it)
        else:
            resp.close()  # not read to the end: the socket's state is unknown, never reused


class UpstreamClient:
    """One aiohttp session and pool for the gateway's upstream calls (see the module docstring)."""

    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        keepalive_s: float = 4.0,
        trust_env: bool = True,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        # No read timeout of its own: callers bound each call with their deadlines (a stream may pause long).
        self.connect_timeout_s, self.keepalive_s, self._ssl = connect_timeout_s, keepalive_s, ssl_context
        self._proxies = urllib.request.getproxies() if trust_env else {}
        self._routes: dict[str, _Route] = {}
        self._session: aiohttp.ClientSession | None = None  # made on first use: aiohttp wants a running loop
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise HTTPError("the upstream client is closed")
        connector = _Connector(limit=0, keepalive_timeout=self.keepalive_s, ssl=self._ssl or True)
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=_SKIP_AUTO_HEADERS,
            timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s),
            trust_env=False,  # proxies are resolved once per route here (see the module docstring)
        )
        return self._session

    async def request(
        self, method: str, url: str, body: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> Response:
        """Send a request and read the status line and headers (see the module docstring on retries)."""
        route = self._routes.get(url) or self._route(url)
        session = self._session or self._open()
        if route.extra_headers is not None:
            headers = {**(headers or {}), **route.extra_headers}
        try:
            resp = await session.request(
                method,
                route.url,
                data=body or None,
                headers=headers,
                allow_redirects=False,
                proxy=route.proxy,
                proxy_headers=route.proxy_headers,
            )
        except aiohttp.ClientHttpProxyError as e:
            raise HTTPError(f"proxy refused CONNECT {route.where}: {e.status} {e.message}") from e
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            raise HTTPError(f"cannot connect to {route.where}: {type(e).__name__}: {e}") from e
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            why = "" if method in _IDEMPOTENT else "; not retried because the request may have been processed"
            raise HTTPError(f"{route.where}: connection closed before a response ({type(e).__name__}){why}") from e
        except _FAILURES as e:
            raise HTTPError(f"{route.where}: bad response: {type(e).__name__}: {e}") from e
        except RuntimeError as e:  # aiohttp's "Session is closed": aclose() ran while this call waited
            raise HTTPError(f"{route.where}: {e}") from e
        return Response(resp, route.where)

    def _route(self, url: str) -> _Route:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise HTTPError(f"unsupported URL scheme: {parts.scheme!r}")
        try:
            route = _Route(url, self._proxy_for(parts.scheme, parts.netloc.rpartition("@")[2]))
        except ValueError as e:
            raise HTTPError(f"bad URL {url!r}: {e}") from e
        if len(self._routes) >= 1024:  # upstream URLs come from config; this only bounds a misuse
            self._routes.clear()
        self._routes[url] = route
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

    async def aclose(self) -> None:
        """Close every socket, idle or still carrying a response (those responses end with HTTPError). Idempotent."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()


async def request_json(
    client: UpstreamClient,
    method: str,
    url: str,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 2.0,
) -> Any:
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


async def request_ok(
    client: UpstreamClient, url: str, headers: Mapping[str, str] | None = None, timeout_s: float = 2.0
) -> bool:
    """Whether a GET of `url` answers 2xx within `timeout_s`, its body read and ignored (a /health probe)."""
    try:
        async with asyncio.timeout(timeout_s):
            r = await client.request("GET", url, b"", headers)
            try:
                await r.read()
            finally:
                await r.aclose()
        return 200 <= r.status_code < 300
    except (HTTPError, TimeoutError):
        return False
