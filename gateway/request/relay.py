"""Relaying one hop's stream to the client: the open upstream stream (`HopStream`), which the request's end closes,
the ASGI response that writes it and notices the client leaving (`StreamResponse`, which hands the request's end back
when its body is over), and the error events that end a stream that broke after its first byte.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenweir.common.http.disconnect import cancel_on_disconnect
from tokenweir.gateway.request.stream_chunks import ChunkFilter
from tokenweir.gateway.upstream.sse import SSEStream


class HopStream:
    """The open upstream stream of one hop: its SSE body (`sse`, None once closed) and what its chunks said so far
    (`chunks`: usage, text, token clock, whether it reached [DONE]). Dispatch opens it and hands it to the request's
    end (gateway/request/request_end.py), which closes it whoever ends the request; settle bills from its chunks."""

    def __init__(self, sse: SSEStream, chunks: ChunkFilter) -> None:
        self.sse: SSEStream | None = sse
        self.chunks = chunks

    async def close(self, drain: bool) -> None:
        """Close the body once (later calls do nothing). `drain`: read it to its end first, so that the keep-alive
        connection goes back to the pool (only for a stream that was read to its [DONE])."""
        if self.sse is None:
            return
        sse, self.sse = self.sse, None
        if drain:
            await sse.drain()
        await sse.aclose()


def sse_error(message: str, code: str, type_: str = "server_error") -> bytes:
    """The last events of a stream that failed after its first byte: an error object, then [DONE]."""
    err = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n"


class StreamResponse(Response):
    """ASGI response for a relayed SSE stream that notices the client leaving.

    `pump(send)` writes the events in this task; a watcher reads `receive` for http.disconnect and cancels it
    when the client goes. `on_end(disconnected, shutdown)` always runs last: the request's end, handed to this
    response by dispatch (gateway/request/request_end.py RequestEnd.hand_to_body), which settles it.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        pump: Callable[[Send], Awaitable[bool]],
        on_end: Callable[[bool, bool], Awaitable[None]],
        headers: dict[str, str],
    ) -> None:
        self.pump, self.on_end = pump, on_end
        self.raw_headers = [(k.encode(), v.encode()) for k, v in headers.items()]
        self.raw_headers += [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected, shutdown = False, False
        watch = cancel_on_disconnect(receive)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            disconnected = not await self.pump(send)  # False: a send failed, the client is gone
        except OSError:
            disconnected = True
        except asyncio.CancelledError:
            if watch.client_left():
                disconnected = True
            else:  # the server is shutting down past its grace: end the stream properly, then go
                shutdown = True
                with contextlib.suppress(Exception):
                    tail = sse_error("The server is shutting down; retry.", "shutting_down", "service_unavailable")
                    await send({"type": "http.response.body", "body": tail, "more_body": False})
                raise
        finally:
            watch.stop()
            await self.on_end(disconnected, shutdown)  # it shields the settle itself
