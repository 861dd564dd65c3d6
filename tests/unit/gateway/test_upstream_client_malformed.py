"""The upstream client against malformed, cut and odd answers, and calls cancelled midway: each ends as HTTPError (or,
complete but odd, as the right answer) within a bound, never a hang, and the next call on the same client gets a
fresh socket. Real sockets: raw asyncio servers writing exact bytes (tests/support/raw_upstream.py)."""

from __future__ import annotations

import asyncio

import aiohttp.client
import pytest

from tests.support.raw_upstream import CUT, INTERIM_THEN_OK, MALFORMED, OK, answer_then_wait_close, read_request, serve
from tokenweir.gateway.upstream import client as client_module
from tokenweir.gateway.upstream.client import HTTPError, Response, UpstreamClient

# Complete but odd: aiohttp may read the answer right (when the extra bytes come in a later packet) or fail it
# (llhttp reads them at once as a bad status line); either way the socket is not used again.
EITHER = {"body-longer-than-content-length": (200, b"ok"), "204-with-a-body": (204, b"")}


def first_answer(raw: bytes, cut: bool, requests: list[tuple[int, str]]):
    """A handler that answers the very first request with `raw` (then closes if `cut`, or waits for the client to
    close) and every later one with OK; `requests` gets (connection number, request line) of each."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        number = connections
        while True:
            line, _ = await read_request(reader)
            requests.append((number, line))
            if len(requests) > 1:
                writer.write(OK)
                continue
            writer.write(raw)
            await writer.drain()
            if cut:
                return
            await reader.read()  # until the client closes its side
            return

    return handle


async def body_of(r: Response, how: str) -> bytes:
    try:
        if how == "read":
            return await r.read()
        return b"".join([part async for part in r.aiter_raw()])
    finally:
        await r.aclose()


async def outcome(client: UpstreamClient, url: str, how: str = "read") -> tuple[int, bytes] | str:
    """(status, body), or "HTTPError" (the error's text checked to be about the answer)."""
    try:
        async with asyncio.timeout(3):
            r = await client.request("POST", url, b"{}", {"content-type": "application/json"})
            return r.status_code, await body_of(r, how)
    except HTTPError as e:
        assert str(e), "an HTTPError says what went wrong"
        return "HTTPError"


@pytest.mark.parametrize("how", ["read", "aiter_raw"])
@pytest.mark.parametrize("case", sorted(MALFORMED) + sorted(CUT))
async def test_a_malformed_or_cut_answer_is_an_http_error_and_the_next_call_gets_a_fresh_socket(case, how):
    requests: list[tuple[int, str]] = []
    raw, cut = (CUT[case], True) if case in CUT else (MALFORMED[case], False)
    async with serve(first_answer(raw, cut, requests)) as (url, connections):
        client = UpstreamClient(trust_env=False)
        got = await outcome(client, url + "/v1/x", how)
        assert got in ("HTTPError", EITHER.get(case)), got
        assert await outcome(client, url + "/v1/y", how) == (200, b"ok"), "the client is still usable"
        assert len(connections) == 2, "the second call did not reuse the first socket"
        assert [n for n, _ in requests] == [1, 2], "each POST sent once, the second on a new connection"
        await client.aclose()


async def test_interim_answers_then_the_final_one_keep_the_socket():
    async def handle(reader, writer):
        while True:
            await read_request(reader)
            writer.write(INTERIM_THEN_OK)

    async with serve(handle) as (url, connections):
        client = UpstreamClient(trust_env=False)
        assert await outcome(client, url) == (200, b"ok")
        assert await outcome(client, url) == (200, b"ok")
        assert len(connections) == 1
        await client.aclose()


@pytest.mark.parametrize("where", ["before the headers", "mid-body"])
async def test_a_call_cancelled_midway_closes_its_socket(where):
    eof = asyncio.Event()
    second = asyncio.Event()

    async def handle(reader, writer):
        if second.is_set():  # the call after the cancelled one
            while True:
                await read_request(reader)
                writer.write(OK)
        second.set()
        await read_request(reader)
        if where == "mid-body":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nstart")
        await reader.read()  # never answers (the rest): waits for the client to close
        eof.set()

    async with serve(handle) as (url, connections):
        client = UpstreamClient(trust_env=False)

        async def call() -> bytes:
            r = await client.request("POST", url, b"{}")
            return await body_of(r, "aiter_raw")

        task = asyncio.create_task(call())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with asyncio.timeout(2):
            await eof.wait()  # the socket was closed, not kept for another call
            assert await outcome(client, url) == (200, b"ok")
        assert len(connections) == 2
        await client.aclose()


async def test_a_deadline_mid_body_closes_the_socket():
    handle, eof = answer_then_wait_close(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n")

    async with serve(handle) as (url, _):
        client = UpstreamClient(trust_env=False)
        r = await client.request("POST", url, b"{}")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await body_of(r, "read")
        async with asyncio.timeout(2):
            await eof.wait()
        await client.aclose()


async def test_closing_the_client_ends_open_responses_and_is_idempotent():
    handle, eof = answer_then_wait_close(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")

    async with serve(handle) as (url, _):
        client = UpstreamClient(trust_env=False)
        r = await client.request("GET", url)
        await client.aclose()  # shutdown while a response is open
        await client.aclose()
        with pytest.raises(HTTPError):
            async with asyncio.timeout(2):
                await r.read()
        await r.aclose()
        async with asyncio.timeout(2):
            await eof.wait()
        with pytest.raises(HTTPError, match="closed"):
            await client.request("GET", url)


async def test_requests_carry_no_headers_the_upstream_does_not_need():
    heads: list[bytes] = []

    async def handle(reader, writer):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            heads.append(head)
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]) if b"ength:" in head else 0
            await reader.readexactly(length)
            writer.write(OK)

    async with serve(handle) as (url, _):
        client = UpstreamClient(trust_env=False)
        assert await outcome(client, url + "/p?q=1") == (200, b"ok")
        r = await client.request("GET", url + "/g")
        await r.aclose()
        await client.aclose()
    names = [sorted(line.split(b":")[0].lower() for line in head.split(b"\r\n")[1:] if line) for head in heads]
    assert heads[0].startswith(b"POST /p?q=1 HTTP/1.1\r\n")
    assert names == [[b"content-length", b"content-type", b"host"], [b"host"]]


def test_the_methods_said_to_be_replayed_are_those_aiohttp_replays():
    """The client's docstring and its errors say which calls aiohttp may send twice: POST must never be one."""
    assert client_module._IDEMPOTENT == aiohttp.client.IDEMPOTENT_METHODS
    assert "POST" not in aiohttp.client.IDEMPOTENT_METHODS
