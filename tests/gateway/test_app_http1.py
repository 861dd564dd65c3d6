"""The upstream HTTP/1.1 client: framing, keep-alive reuse, stale sockets, and cut bodies never reused."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.http1 import HTTP1Pool, HTTPError
from loadtests.fake_upstream import FakeUpstream, ServerThread, free_port


@pytest.fixture(scope="module")
def upstream():
    with ServerThread(FakeUpstream(model="m")) as server:
        yield server.url


async def post(pool: HTTP1Pool, url: str, body: dict) -> tuple[int, bytes]:
    r = await pool.request("POST", url, orjson.dumps(body), {"content-type": "application/json"})
    try:
        return r.status_code, await r.read()
    finally:
        await r.aclose()


async def test_content_length_and_chunked_bodies_and_connection_reuse(upstream):
    pool = HTTP1Pool()
    body = {"model": "m", "prompt": "a b", "max_tokens": 3}
    status, raw = await post(pool, upstream + "/v1/completions", body)
    assert status == 200 and orjson.loads(raw)["choices"][0]["text"] == "tok tok tok "
    status, raw = await post(pool, upstream + "/v1/completions", {**body, "stream": True})
    events = [e for e in raw.split(b"\n\n") if e]
    assert status == 200 and len(events) == 4 and events[-1] == b"data: [DONE]"
    (conn,) = next(iter(pool._idle.values()))  # both requests went over one socket
    status, _ = await post(pool, upstream + "/v1/completions", body)
    assert next(iter(pool._idle.values())) == [conn]
    await pool.aclose()


async def test_a_body_cut_short_closes_the_socket_instead_of_reusing_it(upstream):
    pool = HTTP1Pool()
    r = await pool.request("POST", upstream + "/v1/completions", orjson.dumps({"prompt": "a", "stream": True}))
    first = await anext(r.aiter_raw())
    assert first.startswith(b"data: ")
    await r.aclose()  # not read to the end
    assert not any(pool._idle.values())
    await pool.aclose()


async def test_refused_connection_is_an_http_error():
    pool = HTTP1Pool(connect_timeout_s=1)
    with pytest.raises(HTTPError, match="cannot connect"):
        await pool.request("GET", f"http://127.0.0.1:{free_port()}/health")


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
    pool = HTTP1Pool()
    for _ in range(3):
        r = await pool.request("GET", url)
        assert await r.read() == b"ok"
        await r.aclose()
    assert len(served) == 3
    server.close()
    await pool.aclose()
