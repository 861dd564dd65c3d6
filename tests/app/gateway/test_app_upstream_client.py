"""The upstream HTTP client (gateway/upstream/client.py, aiohttp's): framing, keep-alive reuse, stale sockets,
retries only for idempotent methods, cut bodies never reused. Real sockets: the fake upstream, and tiny asyncio
servers (tests/support/raw_upstream.py) for misbehaving ones."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.support.raw_upstream import OK, answer_then_wait_close, read_request, serve
from tests.support.serve_thread import ServerThread
from tokenweir.gateway.upstream.client import HTTPError, UpstreamClient


def idle(client: UpstreamClient) -> list:
    """The sockets idle in the client's pool (aiohttp's connector: its protocols)."""
    if client._session is None:
        return []
    conns = client._session.connector._conns  # type: ignore[union-attr]
    return [proto for pooled in conns.values() for proto, _ in pooled]


@pytest.fixture(scope="module")
def upstream():
    with ServerThread(FakeUpstream(model="m")) as server:
        yield server.url


async def post(client: UpstreamClient, url: str, body: dict) -> tuple[int, bytes]:
    r = await client.request("POST", url, orjson.dumps(body), {"content-type": "application/json"})
    try:
        return r.status_code, await r.read()
    finally:
        await r.aclose()


async def test_content_length_and_chunked_bodies_and_connection_reuse(upstream):
    client = UpstreamClient()
    body = {"model": "m", "prompt": "a b", "max_tokens": 3}
    status, raw = await post(client, upstream + "/v1/completions", body)
    assert status == 200 and orjson.loads(raw)["choices"][0]["text"] == "tok tok tok "
    status, raw = await post(client, upstream + "/v1/completions", {**body, "stream": True})
    events = [e for e in raw.split(b"\n\n") if e]
    assert status == 200 and len(events) == 4 and events[-1] == b"data: [DONE]"
    (conn,) = idle(client)  # both requests went over one socket
    status, _ = await post(client, upstream + "/v1/completions", body)
    assert idle(client) == [conn]
    await client.aclose()


async def test_a_body_cut_short_closes_the_socket_instead_of_reusing_it(upstream):
    client = UpstreamClient()
    body = {"prompt": "a", "stream": True, "max_tokens": 5, "fake": {"itl_ms": 300}}  # still streaming when cut
    r = await client.request("POST", upstream + "/v1/completions", orjson.dumps(body))
    first = await anext(r.aiter_raw())
    assert first.startswith(b"data: ")
    await r.aclose()  # not read to the end
    assert not idle(client)
    await client.aclose()


async def test_a_body_received_whole_frees_its_socket_even_if_not_read():
    """aiohttp hands a socket back once the response's last byte arrived (the body waits in the response): nothing
    of it is left on the socket for the next request to read."""

    async def handle(reader, writer):
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfirst" if not seen else OK)
            seen.append(1)

    seen: list[int] = []
    async with serve(handle) as (url, connections):
        client = UpstreamClient(trust_env=False)
        async with asyncio.timeout(2):
            r = await client.request("GET", url)
            await asyncio.sleep(0.02)
            await r.aclose()  # never read
            assert await call(client, "GET", url) == (200, b"ok")
        assert len(connections) == 1
        await client.aclose()


async def test_refused_connection_is_an_http_error():
    client = UpstreamClient(connect_timeout_s=1)
    with pytest.raises(HTTPError, match="cannot connect"):
        await client.request("GET", f"http://127.0.0.1:{free_port()}/health")


async def test_a_reused_socket_closed_by_the_server_is_retried_once_on_a_fresh_one():
    served = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        served.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # the server drops keep-alive without saying so

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    client = UpstreamClient()
    for _ in range(3):
        r = await client.request("GET", url)
        assert await r.read() == b"ok"
        await r.aclose()
    assert len(served) == 3
    server.close()
    await client.aclose()


# Misbehaving upstreams: tiny asyncio servers on real sockets.


async def call(client: UpstreamClient, method: str, url: str, body: bytes = b"") -> tuple[int, bytes]:
    r = await client.request(method, url, body)
    try:
        return r.status_code, await r.read()
    finally:
        await r.aclose()


async def test_a_post_on_a_reused_socket_closed_unanswered_is_never_sent_again():
    seen = []

    async def handle(reader, writer):
        seen.append((await read_request(reader))[1])
        writer.write(OK)
        seen.append((await read_request(reader))[1])  # then hang up without answering: was it processed?

    async with serve(handle) as (url, _):
        client = UpstreamClient(trust_env=False)
        assert await call(client, "POST", url, b"one") == (200, b"ok")
        with pytest.raises(HTTPError, match="not retried because the request may have been processed"):
            async with asyncio.timeout(2):
                await client.request("POST", url, b"two")
        assert seen == [b"one", b"two"]  # exactly one copy of the second POST
        await client.aclose()


async def test_a_get_on_a_reused_socket_closed_unanswered_is_retried_once_on_a_fresh_one():
    seen = []

    async def handle(reader, writer):
        seen.append((await read_request(reader))[0])
        writer.write(OK)
        seen.append((await read_request(reader))[0])  # then hang up without answering

    async with serve(handle) as (url, connections):
        client = UpstreamClient(trust_env=False)
        assert await call(client, "GET", url + "/a") == (200, b"ok")
        async with asyncio.timeout(2):
            assert await call(client, "GET", url + "/b") == (200, b"ok")
        assert seen == ["GET /a HTTP/1.1", "GET /b HTTP/1.1", "GET /b HTTP/1.1"]
        assert len(connections) == 2
        await client.aclose()


async def test_a_retried_get_is_not_retried_a_second_time():
    seen = []

    async def handle(reader, writer):
        seen.append((await read_request(reader))[0])
        if len(seen) == 1:  # only the very first request is ever answered
            writer.write(OK)
            seen.append((await read_request(reader))[0])

    async with serve(handle) as (url, _):
        client = UpstreamClient(trust_env=False)
        assert await call(client, "GET", url + "/a") == (200, b"ok")
        with pytest.raises(HTTPError, match="closed before a response"):
            async with asyncio.timeout(2):
                await client.request("GET", url + "/b")
        assert seen == ["GET /a HTTP/1.1", "GET /b HTTP/1.1", "GET /b HTTP/1.1"]
        await client.aclose()


async def test_a_pooled_socket_found_closed_before_writing_is_replaced_even_for_a_post():
    seen, closed = [], asyncio.Event()

    async def handle(reader, writer):
        seen.append((await read_request(reader))[1])
        writer.write(OK)
        await writer.drain()
        writer.close()  # the server's idle timeout: it closes a kept-alive socket between requests
        await writer.wait_closed()
        closed.set()

    async with serve(handle) as (url, connections):
        client = UpstreamClient(trust_env=False)
        assert await call(client, "POST", url, b"one") == (200, b"ok")
        await closed.wait()
        await asyncio.sleep(0.02)  # the client's event loop reads the FIN
        assert await call(client, "POST", url, b"two") == (200, b"ok")
        assert seen == [b"one", b"two"] and len(connections) == 2
        await client.aclose()


async def test_unsolicited_bytes_on_an_idle_socket_are_never_read_as_the_next_answer():
    send_408 = asyncio.Event()

    async def handle(reader, writer):
        await read_request(reader)
        writer.write(OK)
        await send_408.wait()  # some servers say 408 before an idle close; this one keeps the socket open
        writer.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n")
        await reader.read()

    async with serve(handle) as (url, connections):
        client = UpstreamClient(trust_env=False)
        assert await call(client, "POST", url, b"one") == (200, b"ok")
        send_408.set()
        await asyncio.sleep(0.02)
        async with asyncio.timeout(2):
            assert await call(client, "POST", url, b"two") == (200, b"ok")
        assert len(connections) == 2
        await client.aclose()


async def test_interim_1xx_responses_are_skipped():
    async def handle(reader, writer):
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n" + OK)

    async with serve(handle) as (url, connections):
        client = UpstreamClient(trust_env=False)
        async with asyncio.timeout(2):
            assert await call(client, "POST", url, b"{}") == (200, b"ok")
            assert await call(client, "POST", url, b"{}") == (200, b"ok")
        assert len(connections) == 1
        await client.aclose()


async def test_204_304_and_head_answers_have_no_body_and_keep_the_socket():
    async def handle(reader, writer):
        while True:
            line, _ = await read_request(reader)
            if line.startswith("HEAD"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
            elif "/304" in line:
                writer.write(b"HTTP/1.1 304 Not Modified\r\netag: x\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")

    async with serve(handle) as (url, connections):
        client = UpstreamClient(trust_env=False)
        async with asyncio.timeout(2):
            assert await call(client, "POST", url + "/204", b"{}") == (204, b"")
            assert await call(client, "GET", url + "/304") == (304, b"")
            assert await call(client, "HEAD", url + "/") == (200, b"")
            r = await client.request("GET", url + "/204")
            await r.aclose()  # not even read: a bodiless answer is complete, the socket goes back
        assert len(connections) == 1 and len(idle(client)) == 1
        await client.aclose()


async def test_sockets_that_cannot_carry_another_request_are_not_pooled():
    async def handle(reader, writer):
        while True:
            line, _ = await read_request(reader)
            if "/http10" in line:  # HTTP/1.0 without keep-alive: the server may close after it
                writer.write(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok")
            elif "/extra" in line:  # more bytes than the framing said: garbage ahead of the next answer
                writer.write(OK + b"junk")  # (llhttp fails the answer on them: tests/unit/.../malformed)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nconnection: keep-alive, close\r\ncontent-length: 2\r\n\r\nok")

    async with serve(handle) as (url, connections):
        client = UpstreamClient(trust_env=False)
        for path in ("/http10", "/extra", "/close"):
            async with asyncio.timeout(2):
                if path == "/extra":
                    with pytest.raises(HTTPError, match="Bad status line"):
                        await call(client, "GET", url + path)
                else:
                    assert await call(client, "GET", url + path) == (200, b"ok")
            assert not idle(client), path
        assert len(connections) == 3
        await client.aclose()


async def test_a_bad_content_length_is_an_http_error_and_closes_the_socket():
    handle, eof = answer_then_wait_close(b"HTTP/1.1 200 OK\r\ncontent-length: 1x\r\n\r\nok")

    async with serve(handle) as (url, _):
        client = UpstreamClient(trust_env=False)
        with pytest.raises(HTTPError, match="(?i)content-length"):
            await client.request("POST", url, b"{}")
        async with asyncio.timeout(2):
            await eof.wait()
        await client.aclose()


async def test_idle_sockets_past_keepalive_are_closed_even_if_their_host_is_not_called_again():
    quiet, eof = answer_then_wait_close(OK)

    async def other(reader, writer):
        while True:
            await read_request(reader)
            writer.write(OK)

    async with serve(quiet) as (url_a, _), serve(other) as (url_b, _):
        client = UpstreamClient(trust_env=False, keepalive_s=0.05)
        assert await call(client, "GET", url_a) == (200, b"ok")
        await asyncio.sleep(0.1)
        assert await call(client, "GET", url_b) == (200, b"ok")
        async with asyncio.timeout(2):
            await eof.wait()
        assert len(idle(client)) == 1
        await client.aclose()


async def test_a_response_finished_after_the_pool_closed_does_not_go_back_into_it():
    handle, eof = answer_then_wait_close(OK)

    async with serve(handle) as (url, _):
        client = UpstreamClient(trust_env=False)
        r = await client.request("GET", url)
        await client.aclose()  # shutdown while a response is open
        assert await r.read() == b"ok"
        await r.aclose()
        assert not idle(client)
        async with asyncio.timeout(2):
            await eof.wait()
