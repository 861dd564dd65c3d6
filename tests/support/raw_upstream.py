"""Misbehaving upstreams on real sockets: a tiny asyncio server on 127.0.0.1:<free port> that writes exactly the
bytes a test hands it, for the upstream client's tests (tests/app/gateway/test_app_upstream_client.py, ...)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import orjson

from tests.support.serve_thread import serve_app
from tokenweir.gateway.config import BreakerConfig, EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
# a whole, well-formed completion (1 token for a 3-token prompt), as an upstream's answer
COMPLETION = {
    "id": "c",
    "object": "text_completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "text": "hi", "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}
GOOD = orjson.dumps(COMPLETION)
GOOD_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(GOOD), GOOD)


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[tuple[str, list[asyncio.StreamWriter]]]:
    """Run `handler(reader, writer)` per connection on this loop; yields (base URL, one writer per connection
    accepted so far). The socket closes when the handler returns."""
    tasks: set[asyncio.Task] = set()
    connections: list[asyncio.StreamWriter] = []

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        connections.append(writer)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # (a cancelled handler task would make asyncio log an error)
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(run, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", connections
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    """(request line, body) of one Content-Length-framed request."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head.split(b"\r\n", 1)[0].decode(), await reader.readexactly(length)


def answer_then_wait_close(raw: bytes) -> tuple[Handler, asyncio.Event]:
    """A handler that answers one request with `raw`, then reads until the client closes its socket, and the event
    it sets then: set = the client did not keep that socket."""
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(raw)
        await reader.read()
        closed.set()

    return handle, closed


# Malformed or odd answers, each written in one piece. The bad ones must end a call with HTTPError and leave no
# socket to reuse; the odd but complete ones must be read correctly.
MALFORMED = {
    "chunk-size-not-hex": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
    "chunk-size-negative": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-2\r\nab\r\n0\r\n\r\n",
    "chunk-size-huge": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"f" * 40 + b"\r\nab\r\n0\r\n\r\n",
    "chunk-size-bad-after-a-good-chunk": (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\nq\r\nxy\r\n0\r\n\r\n"
    ),
    "header-too-long": b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 100_000 + b"\r\ncontent-length: 2\r\n\r\nok",
    "too-many-headers": b"HTTP/1.1 200 OK\r\n" + b"x-h: a\r\n" * 1000 + b"content-length: 2\r\n\r\nok",
    "content-length-not-a-number": b"HTTP/1.1 200 OK\r\ncontent-length: 1x\r\n\r\nok",
    "not-http": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "body-longer-than-content-length": OK + b"junk after the body",
    "204-with-a-body": b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\nhello",
}
# Answers cut by a close after these bytes (the socket closes when the handler returns).
CUT = {
    "closed-mid-body": b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial",
    "closed-mid-chunk": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\npartial",
    "closed-mid-headers": b"HTTP/1.1 200 OK\r\ncontent-len",
    "closed-before-the-last-chunk": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n",
}
INTERIM_THEN_OK = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n" + OK


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A port that takes connections (its backlog holds them) and never answers: an upstream hung for good."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


@contextlib.asynccontextmanager
async def gateway_over(tmp_path: Path, upstream: Handler) -> AsyncIterator[dict]:
    """A gateway whose one pool (model `m`) is `upstream` on a socket of its own, its breaker never opening so every
    case reaches the upstream; yields {"store", "events" (the JSONL path), "url", "gw" (the server), "up"}."""
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    async with serve(upstream) as (url, _):
        config = GatewayConfig(
            port=0,
            pools=[PoolConfig(model="m", upstreams=[UpstreamConfig(url, name="raw")])],
            breaker=BreakerConfig(failures=1000, cooldown_s=60),
            events=EventsConfig(path=str(tmp_path / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
        )
        server = serve_app(config, store=store)
        await asyncio.to_thread(server.__enter__)
        try:
            yield {"store": store, "events": tmp_path / "events.jsonl", "url": server.url, "gw": server, "up": upstream}
        finally:
            await asyncio.to_thread(server.__exit__, None, None, None)
    store.close()
