"""uvicorn's HTTP protocols with `HttpLimits` enforced at the door, before the app sees a request.

httptools (the one uvicorn picks when installed) gets the whole set: head bytes counted as they arrive (a never-ending
header is cut at the limit, not buffered) and again per parsed field, the field count, a deadline for the whole head,
a longest pause inside a body the app reads, the body's size (where bounded) and the per-process connection cap. The
h11 fallback gets the same limits, checked after each read: a head over the field limit reaches the app, which then
sees `http.disconnect`.

A refusal is an OpenAI-shaped JSON error with `connection: close`, written straight to the transport; a request the
app is already handling (a stalled body) sees `http.disconnect`. Nothing is written into a response already under
way: that connection is only closed.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenweir.common.http.door_limits import HttpLimits
from tokenweir.common.http.door_refusals import (
    Refusal,
    body_too_large,
    content_length_over,
    head_too_large,
    too_many_fields,
)
from tokenweir.common.http.head_with_body import HeadWithBody

if TYPE_CHECKING:
    import logging

    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.h11_impl import RequestResponseCycle as H11Cycle
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as HttpToolsCycle
    from uvicorn.server import Protocols, ServerState

try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # uvicorn without its [standard] extras
    # mypy reads the installed extras; the None stands for their absence (checked before either is used)
    httptools = None  # type: ignore[assignment]
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


class _Cycle(Protocol):
    """What the door reads and sets of uvicorn's per-request cycle (h11's and httptools' classes alike)."""

    response_started: bool
    response_complete: bool
    disconnected: bool
    message_event: asyncio.Event


if TYPE_CHECKING:
    _ProtocolBase = asyncio.Protocol
else:
    _ProtocolBase = object


class _Door(_ProtocolBase):
    """The limits common to both parsers; mixed in before uvicorn's protocol class."""

    limits: HttpLimits = HttpLimits()  # each server's own: see protocol_class()

    if TYPE_CHECKING:  # set by the uvicorn protocol class the door is mixed into
        connections: set[Protocols]
        loop: asyncio.AbstractEventLoop
        transport: asyncio.Transport
        flow: FlowControl
        client: tuple[str, int] | None
        logger: logging.Logger
        server_state: ServerState
        cycle: _Cycle | None  # None before the connection's first request

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # a byte of the current head arrived: its timeout is a 408, not a quiet close
        self._head_bytes = 0
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_last = 0.0
        self._body_bytes = 0

    def _reading_body(self) -> bool:
        raise NotImplementedError

    def _waiting_for_100_continue(self) -> bool:
        raise NotImplementedError

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(
                Refusal(
                    503,
                    "too_many_connections",
                    f"This server holds its limit of {self.limits.max_connections} open connections; retry shortly.",
                    ((b"retry-after", b"1"),),
                )
            )
            return
        self._arm_head()  # a connection that never sends a request is not kept

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head()
        self._stop_body()
        super().connection_lost(exc)

    # --- the head's deadline ------------------------------------------------------------------------------------

    def _arm_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _stop_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_done(self) -> None:
        self._stop_head()
        self._head_started = False
        self._head_bytes = 0

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head()  # a pipelined head waits behind the response before it: not the client's delay
        elif not self._head_started:
            self.transport.close()
        else:
            timeout = self.limits.header_timeout_s
            self._refuse(
                Refusal(
                    408,
                    "header_timeout",
                    f"The request line and headers did not arrive within {timeout:g} s; send them at once.",
                )
            )

    def _count_head(self, n: int) -> None:
        """Head bytes buffered so far: a head that never ends is cut here, at the limit, not after."""
        self._head_bytes += n
        if self._head_bytes > self.limits.max_header_bytes:
            self._refuse(head_too_large(self.limits))

    # --- the body's longest pause -------------------------------------------------------------------------------

    def _body_arrived(self) -> None:
        self._body_last = self.loop.time()
        if self._body_timer is None:
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def _stop_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or not self._reading_body():
            return
        if cycle is None or cycle.response_complete:  # answered already (a 413, a 401): the rest is not worth a wait
            self.transport.close()
            return
        now = self.loop.time()
        if self.flow.read_paused or self._waiting_for_100_continue():
            self._body_last = now  # the app holds the body back (not reading yet), not the client
        idle = now - self._body_last
        if idle < self.limits.body_timeout_s:
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s - idle, self._body_timed_out)
            return
        timeout = self.limits.body_timeout_s
        self._refuse(
            Refusal(
                408,
                "body_timeout",
                f"The request body stopped arriving for {timeout:g} s; send the whole body without pausing.",
                in_flight=True,
            )
        )

    # --- refusing -----------------------------------------------------------------------------------------------

    def _refuse(self, refusal: Refusal) -> None:
        self._stop_head()
        self._stop_body()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started or not refusal.in_flight:
                self.transport.close()  # a response is under way, or this is about a later (pipelined) request
                return
            cycle.disconnected = True  # the app reading this body sees http.disconnect; what it sends is dropped
            cycle.message_event.set()
        client = f"{self.client[0]}:{self.client[1]} - " if self.client else ""
        self.logger.warning("%s%d %s: %s", client, refusal.status, refusal.code, refusal.message)
        self.transport.write(refusal.response(self.server_state.default_headers))
        self.transport.close()


if HttpToolsProtocol is not None:

    class DoorHttpToolsProtocol(_Door, HttpToolsProtocol):
        """httptools: head bytes counted per read (before the parser buffers them) and per parsed field."""

        if TYPE_CHECKING:  # as uvicorn declares it (without the None): the door's own view would clash with it
            cycle: HttpToolsCycle

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_body = False  # between a head's end and its message's end
            self._heads = 0  # heads completed: a read that completes one is not all head bytes
            self._fields = 0
            self._field_bytes = 0

        def _reading_body(self) -> bool:
            return self._in_body

        def _waiting_for_100_continue(self) -> bool:
            return self.cycle is not None and self.cycle.waiting_for_100_continue

        def data_received(self, data: bytes) -> None:
            self._unset_keepalive_if_required()
            in_head, heads = not self._in_body, self._heads
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserCallbackError as exc:
                if isinstance(exc.__context__, Refusal):
                    self._refuse(exc.__context__)
                else:
                    self._invalid()
                return
            except httptools.HttpParserError:
                self._invalid()
                return
            except httptools.HttpParserUpgrade:
                self._stop_head()
                self._stop_body()  # the connection is a websocket's from now on
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            if self.transport.is_closing():
                return
            # Timers only for what is left incomplete at the end of a read: a request that arrives whole costs none.
            if self._in_body:
                self._body_arrived()
                return
            if in_head and self._heads == heads:
                # All of this read went into a head still incomplete (held in the parser); a read that also ended
                # a head is left to the exact per-field count.
                self._head_started = True
                self._count_head(len(data))
            if self._head_started and not self.transport.is_closing():
                self._arm_head()

        def _invalid(self) -> None:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._fields, self._field_bytes = 0, 16  # the request line's method, version, spaces and CRLF
            self._head_started = True

        def on_url(self, url: bytes) -> None:
            self._add_field_bytes(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._fields += 1
            if self._fields > self.limits.max_header_fields:
                raise too_many_fields(self.limits)
            self._add_field_bytes(len(name) + len(value) + 4)  # + ": " and CRLF
            if content_length_over([(name.lower(), value)], self.limits.max_body_bytes):
                raise body_too_large(self.limits, in_flight=False)
            super().on_header(name, value)

        def _add_field_bytes(self, n: int) -> None:
            self._field_bytes += n
            if self._field_bytes > self.limits.max_header_bytes:
                raise head_too_large(self.limits)

        def on_headers_complete(self) -> None:
            self._heads += 1
            self._in_body = True
            self._body_bytes = 0
            self._head_done()
            super().on_headers_complete()
            if self.cycle is not None and self.cycle.transport is self.transport:  # a new request's cycle
                self.cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]
            self._body_last = self.loop.time()

        def on_body(self, body: bytes) -> None:
            self._body_bytes += len(body)
            if self.limits.max_body_bytes is not None and self._body_bytes > self.limits.max_body_bytes:
                raise body_too_large(self.limits)  # chunked, or past its Content-Length's promise
            super().on_body(body)
            self._body_last = self.loop.time()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_body = False
            self._stop_body()


class DoorH11Protocol(_Door, H11Protocol):
    """h11 (where httptools is missing): checked after each read, as uvicorn hands the parsed request to the app
    within it; h11 also caps its buffer (`h11_max_incomplete_event_size`) a read above `max_header_bytes`."""

    if TYPE_CHECKING:  # as uvicorn declares it (without the None): the door's own view would clash with it
        cycle: H11Cycle

    def _reading_body(self) -> bool:
        return self.conn.their_state is h11.SEND_BODY

    def _waiting_for_100_continue(self) -> bool:
        return self.conn.they_are_waiting_for_100_continue

    def data_received(self, data: bytes) -> None:
        before = self.conn.their_state
        in_head = before is h11.IDLE
        super().data_received(data)
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if in_head:
                self._head_started = True
                self._count_head(len(data))
                if not self.transport.is_closing():
                    self._arm_head()
            return
        if in_head:  # the head arrived in this read, and the app has the request already
            self._head_done()
            self._body_bytes = 0
            if len(self.headers) > self.limits.max_header_fields:
                self._refuse(too_many_fields(self.limits, in_flight=True))
                return
            if content_length_over(self.headers, self.limits.max_body_bytes):
                self._refuse(body_too_large(self.limits))
                return
        elif before is h11.SEND_BODY:
            self._body_bytes += len(data)  # all body, but for a pipelined request's first bytes
            if self.limits.max_body_bytes is not None and self._body_bytes > self.limits.max_body_bytes:
                self._refuse(body_too_large(self.limits))
                return
        if state is h11.SEND_BODY:
            self._body_arrived()
        else:
            self._stop_body()


def protocol_class(limits: HttpLimits, parser: str = "auto") -> type[asyncio.Protocol]:
    """A protocol class for `uvicorn.Config(http=...)` enforcing `limits`; parser "auto": httptools' where it is
    installed (as uvicorn picks), else h11's."""
    h11_only = parser == "h11" or HttpToolsProtocol is None
    base = DoorH11Protocol if h11_only else DoorHttpToolsProtocol
    return type(base.__name__, (base,), {"limits": limits})
