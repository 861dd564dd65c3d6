"""The upstream HTTP client through proxies: HTTP_PROXY / HTTPS_PROXY / NO_PROXY, absolute-form targets,
CONNECT tunnels with TLS inside. Real sockets: a tiny forward proxy and upstreams on 127.0.0.1:<free port>."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
import ssl
import subprocess
from urllib.parse import urlsplit

import pytest

from tokenweir.gateway.upstream.client import HTTPError, UpstreamClient

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
PROXY_VARS = ("http_proxy", "https_proxy", "no_proxy", "all_proxy")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.delenv("REQUEST_METHOD", raising=False)  # under CGI urllib ignores HTTP_PROXY


@contextlib.asynccontextmanager
async def serve(handler, ssl_context: ssl.SSLContext | None = None):
    """Run `handler(reader, writer)` per connection on 127.0.0.1:<free port>; yields the port."""
    tasks: set[asyncio.Task] = set()

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks.add(asyncio.current_task())
        try:
            await handler(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            tasks.discard(asyncio.current_task())

    server = await asyncio.start_server(run, "127.0.0.1", 0, ssl=ssl_context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def read_head(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    """(first line, headers with lowercased names, body by Content-Length)."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return lines[0], headers, body


async def upstream(reader, writer):
    """Answers every request with `ok`, keeping the connection."""
    while True:
        await read_head(reader)
        writer.write(OK)


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


class Proxy:
    """A forward proxy that records what it got: absolute-form requests are forwarded in origin form (any host
    goes to 127.0.0.1, so test hostnames need no DNS); CONNECT is answered 200 (or `refuse`) and tunnelled."""

    def __init__(self, refuse: bytes | None = None) -> None:
        self.lines: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.connections = 0
        self.refuse = refuse

    async def __call__(self, reader, writer) -> None:
        self.connections += 1
        while True:
            line, headers, body = await read_head(reader)
            self.lines.append(line)
            self.headers.append(headers)
            method, target, _ = line.split(" ")
            if method == "CONNECT":
                if self.refuse:
                    writer.write(self.refuse)
                    return
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", int(target.rsplit(":", 1)[1]))
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
                return
            url = urlsplit(target)
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", url.port)
            rest = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k != "proxy-authorization")
            up_writer.write(f"{method} {url.path}?{url.query} HTTP/1.1\r\n{rest}\r\n".encode() + body)
            status, up_headers, up_body = await read_head(up_reader)
            up_writer.close()
            writer.write(f"{status}\r\ncontent-length: {len(up_body)}\r\n\r\n".encode() + up_body)


async def get(client: UpstreamClient, url: str, method: str = "GET", body: bytes = b"") -> tuple[int, bytes]:
    async with asyncio.timeout(2):
        r = await client.request(method, url, body)
        try:
            return r.status_code, await r.read()
        finally:
            await r.aclose()


async def test_http_proxy_gets_absolute_form_targets_with_credentials_and_connections_are_reused(monkeypatch):
    proxy = Proxy()
    async with serve(upstream) as up, serve(proxy) as pp:
        monkeypatch.setenv("HTTP_PROXY", f"http://bob:p%40ss@127.0.0.1:{pp}")
        client = UpstreamClient()
        monkeypatch.delenv("HTTP_PROXY")  # read once, when the client was made
        assert await get(client, f"http://upstream.test:{up}/v1/x?q=1", "POST", b"{}") == (200, b"ok")
        assert await get(client, f"http://upstream.test:{up}/v1/y?q=2", "POST", b"{}") == (200, b"ok")
        await client.aclose()
    assert proxy.lines == [
        f"POST http://upstream.test:{up}/v1/x?q=1 HTTP/1.1",
        f"POST http://upstream.test:{up}/v1/y?q=2 HTTP/1.1",
    ]
    assert proxy.headers[0]["host"] == f"upstream.test:{up}"
    assert proxy.headers[0]["proxy-authorization"] == "Basic " + base64.b64encode(b"bob:p@ss").decode()
    assert proxy.connections == 1


@pytest.mark.parametrize(
    ("no_proxy", "host"), [("localhost,127.0.0.1", "127.0.0.1"), ("*", "127.0.0.1"), ("LOCALHOST", "localhost")]
)
async def test_no_proxy_hosts_go_direct(monkeypatch, no_proxy, host):
    proxy = Proxy()
    async with serve(upstream) as up, serve(proxy) as pp:
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{pp}")  # lowercase variants count too
        monkeypatch.setenv("no_proxy", no_proxy)
        client = UpstreamClient()
        assert await get(client, f"http://{host}:{up}/health") == (200, b"ok")
        await client.aclose()
    assert proxy.lines == []


async def test_no_proxy_domain_suffixes_and_trust_env_false(monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", ".example.com, internal.net")
    client = UpstreamClient()
    assert client._proxy_for("http", "api.example.com:8000") is None
    assert client._proxy_for("http", "a.internal.net") is None
    assert client._proxy_for("http", "example.org") == ("proxy.internal", 3128, None)
    assert client._proxy_for("https", "example.org") is None  # no HTTPS_PROXY
    assert UpstreamClient(trust_env=False)._proxy_for("http", "example.org") is None


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server context, client context trusting it) for a self-signed cert for upstream.test."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl CLI to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=upstream.test"]
        + ["-addext", "subjectAltName=DNS:upstream.test"],
        check=True,
        capture_output=True,
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=str(cert))


async def test_https_goes_through_a_connect_tunnel_with_tls_to_the_target(monkeypatch, tls):
    server_ctx, client_ctx = tls
    proxy = Proxy()
    async with serve(upstream, server_ctx) as up, serve(proxy) as pp:
        monkeypatch.setenv("HTTPS_PROXY", f"http://u:pw@127.0.0.1:{pp}")
        client = UpstreamClient(ssl_context=client_ctx)
        assert await get(client, f"https://upstream.test:{up}/v1/x", "POST", b"{}") == (200, b"ok")
        assert await get(client, f"https://upstream.test:{up}/v1/y", "POST", b"{}") == (200, b"ok")
        await client.aclose()
    assert proxy.lines == [f"CONNECT upstream.test:{up} HTTP/1.1"]  # one tunnel, reused; the requests inside
    assert proxy.headers[0]["proxy-authorization"] == "Basic " + base64.b64encode(b"u:pw").decode()


async def test_a_refused_connect_is_an_http_error(monkeypatch, tls):
    proxy = Proxy(refuse=b"HTTP/1.1 407 Proxy Authentication Required\r\ncontent-length: 0\r\n\r\n")
    async with serve(proxy) as pp:
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{pp}")
        client = UpstreamClient(ssl_context=tls[1])
        with pytest.raises(HTTPError, match="407"):
            await get(client, "https://upstream.test:443/v1/x")
        await client.aclose()
    assert proxy.lines == ["CONNECT upstream.test:443 HTTP/1.1"]


async def test_tls_inside_the_tunnel_is_really_negotiated(monkeypatch, tls):
    async def plain(reader, writer):  # not TLS: answers the ClientHello with plain HTTP
        await reader.read(1)
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    proxy = Proxy()
    async with serve(plain) as up, serve(proxy) as pp:
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{pp}")
        client = UpstreamClient(ssl_context=tls[1])
        with pytest.raises(HTTPError, match="SSL"):
            await get(client, f"https://upstream.test:{up}/v1/x")
        await client.aclose()
    assert proxy.lines == [f"CONNECT upstream.test:{up} HTTP/1.1"]


async def test_an_unsupported_proxy_scheme_is_an_http_error(monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "socks5://127.0.0.1:1080")
    client = UpstreamClient()
    with pytest.raises(HTTPError, match="only http:// proxies"):
        await client.request("GET", "http://upstream.test/health")
    await client.aclose()
