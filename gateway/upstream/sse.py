"""An upstream's SSE body, read into its events' `data:` payloads with a bound on what is buffered.

An event ends at a blank line (`\\n\\n`; `\\r\\n` line ends are read as `\\n`, also when a chunk ends between the
two). What is buffered is the unfinished event only, and each feed searches only the bytes that arrived since the
last one (plus the one byte before them, for a blank line split across chunks): reading a body costs time linear in
its length, however it is cut into chunks. An event, or the unfinished part of one, longer than `MAX_EVENT_BYTES`
raises `EventTooLarge`, an `HTTPError`: the stream ends as a broken upstream stream, as one cut off mid-body does
(a 503 and the next hop before the first event; after it, the client's `upstream_broken` error event and the bill of a
cut stream). Upstreams' events stay far below the bound: a chunk of a few tokens with their top-20 logprobs is a few
KiB; even an answer sent whole as one event passes it only past some 250k tokens of text.
"""

from __future__ import annotations

import asyncio
from collections import deque

from tokenweir.gateway.upstream.client import HTTPError
from tokenweir.gateway.upstream.client import Response as UpstreamResponse

MAX_EVENT_BYTES = 1 << 20  # 1 MiB: the longest SSE event (or line) read from an upstream


class EventTooLarge(HTTPError):
    """An upstream sent an SSE event (or a line without an end) longer than the bound."""


class SSEReader:
    """Chunks in, complete events' `data:` payloads out (bytes, stripped), in order."""

    __slots__ = ("_buf", "_cr", "max_event_bytes", "scanned")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buf = bytearray()  # the unfinished event: searched to its end, holds no blank line
        self._cr = False  # the last chunk ended with "\r": its "\n" may start the next one
        self.max_event_bytes = max_event_bytes
        self.scanned = 0  # bytes searched for an event's end, in all: the body's length at most, plus one per chunk

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of the events this chunk completes. EventTooLarge past the bound."""
        if self._cr:
            chunk, self._cr = b"\r" + chunk, False
        if b"\r" in chunk:
            if chunk.endswith(b"\r"):
                chunk, self._cr = chunk[:-1], True
            chunk = chunk.replace(b"\r\n", b"\n")
        buf, events = self._buf, []  # the events this chunk ends, whole
        if buf:  # an event is unfinished: its end may be in this chunk (a blank line may straddle the two)
            pos = len(buf) - 1  # the bytes before were searched already
            buf += chunk
            end = buf.find(b"\n\n", pos)
            if end == -1:
                self.scanned += len(buf) - pos
                self._check_unfinished()
                return []
            self.scanned += end + 2 - pos
            events.append(bytes(buf[:end]))
            chunk = bytes(buf[end + 2 :])
            buf.clear()
        self.scanned += len(chunk)
        *complete, rest = chunk.split(b"\n\n")
        events += complete
        if rest:
            buf += rest
        payloads: list[bytes] = []
        for event in events:
            if len(event) > self.max_event_bytes:
                raise EventTooLarge(f"an SSE event of {len(event)} bytes, over the bound of {self.max_event_bytes}")
            if b"\n" not in event:  # the usual event: one data line
                if event.startswith(b"data:"):
                    payloads.append(event[5:].strip())
                continue
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    payloads.append(line[5:].strip())
        self._check_unfinished()
        return payloads

    def _check_unfinished(self) -> None:
        if len(self._buf) > self.max_event_bytes:
            raise EventTooLarge(
                f"an SSE event still unfinished after {len(self._buf)} bytes, over the bound of {self.max_event_bytes}"
            )


class SSEStream:
    """An open upstream SSE response, read event by event (each `data:` payload as bytes), bounded and in linear time
    (SSEReader: an event over its bound raises HTTPError, as a body cut short does)."""

    def __init__(self, response: UpstreamResponse) -> None:
        self.response = response
        self._raw = response.aiter_raw()
        self._reader = SSEReader()
        self._events: deque[bytes] = deque()

    async def next(self, deadline: float | None = None) -> bytes | None:
        """The next data payload, None at the end of the body. TimeoutError past the deadline (if given)."""
        while not self._events:
            try:
                if deadline is None:  # the caller holds one timeout around its whole loop (cheaper per chunk)
                    chunk = await anext(self._raw)
                else:
                    async with asyncio.timeout_at(deadline):
                        chunk = await anext(self._raw)
            except StopAsyncIteration:
                return None
            self._events.extend(self._reader.feed(chunk))
        return self._events.popleft()

    @property
    def buffered(self) -> bool:
        """Events already read and waiting: the relay can send them in one write."""
        return bool(self._events)

    async def drain(self, timeout_s: float = 1.0) -> None:
        """Consume what is left after [DONE] (usually just the chunked-encoding terminator)."""
        try:
            async with asyncio.timeout(timeout_s):
                async for _ in self._raw:
                    pass
        except (TimeoutError, HTTPError):
            pass

    async def aclose(self) -> None:
        await self.response.aclose()
