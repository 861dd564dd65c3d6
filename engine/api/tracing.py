"""Traces of the engine's generation requests (OpenTelemetry), off by default: on with `--otlp-traces-endpoint URL`
or `--enable-tracing` (engine/flags.py), or `build_app(..., tracer_provider=...)` in process.

A request continues the W3C `traceparent` it came with (the gateway sends its hop span's), else starts a trace. Its
spans are made after the fact, once its response is over, with the timestamps the request recorded itself
(engine/core/output.py RequestTimings): a SERVER span from the route's start to the response's end and, under it,
`queue` (arrival to first scheduled), `prefill` (to the first token) and `decode` (to the last token). The engine
thread never touches a span, and a request that is not traced costs its route one `is None` test. Off, the app has
no TracingMiddleware and nothing of opentelemetry is imported (every import of it is inside a function).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenweir.common.tracing import epoch_ns, parent_context

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer, TracerProvider

    from tokenweir.engine.core.async_engine import RequestStream
    from tokenweir.engine.core.output import RequestTimings

log = logging.getLogger("tokenweir.engine")
TRACER_NAME = "tokenweir.engine"
SERVICE_NAME = "tokenweir-engine"
TRACE_KEY = "tokenweir.trace"  # where the ASGI scope of a traced request carries its TracedRequest


@dataclass(slots=True)
class TracedRequest:
    """What the middleware and the route learn of a traced request: when it started (time.monotonic()), the
    engine request a generation route started for it (None: no generation, nothing to record), its HTTP status."""

    started: float
    stream: RequestStream | None = None
    status: int | None = None


def trace_request(scope: Scope, stream: RequestStream) -> None:
    """A generation route's one hook: the engine request it started, if the request is traced."""
    traced = scope.get(TRACE_KEY)
    if traced is not None:
        traced.stream = stream


class TracingMiddleware:
    """Pure ASGI (a stream's body is sent inside the app's call, so the request is over when it returns): marks
    each request as traced, and records the spans of one that ran a generation."""

    def __init__(self, app: ASGIApp, tracer_provider: TracerProvider) -> None:
        self.app = app
        self.tracer: Tracer = tracer_provider.get_tracer(TRACER_NAME)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        traced = scope[TRACE_KEY] = TracedRequest(time.monotonic())

        async def send_noting_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                traced.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            if traced.stream is not None:
                try:
                    record(self.tracer, scope, traced, time.monotonic())
                except Exception:  # noqa: BLE001 - the answer is out; a trace that failed must not look like it failed
                    log.exception("trace_record_failed")


def phases(timings: RequestTimings, ended: float) -> list[tuple[str, float, float]]:
    """(name, start, end) of the phases a request went through, in order, up to where it got; a phase it was in
    when it ended (aborted while it waited or computed) ends at `ended`."""
    out = [("queue", timings.arrival, timings.first_scheduled or ended)]
    if timings.first_scheduled is not None:
        out.append(("prefill", timings.first_scheduled, timings.first_token or ended))
    if timings.first_token is not None:
        out.append(("decode", timings.first_token, timings.last_token or ended))
    return out


def record(tracer: Tracer, scope: Scope, traced: TracedRequest, ended: float) -> None:
    """The request's spans, after the fact."""
    from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

    assert traced.stream is not None  # only a request that ran a generation is recorded
    stream, final = traced.stream, traced.stream.final
    to_ns = epoch_ns(time.monotonic)
    traceparent = dict(scope["headers"]).get(b"traceparent", b"").decode("latin-1")
    root = tracer.start_span(
        f"{scope['method']} {scope['path']}",
        context=parent_context(traceparent),
        kind=SpanKind.SERVER,
        start_time=to_ns(traced.started),
        attributes={
            "http.request.method": scope["method"],
            "url.path": scope["path"],
            "tokenweir.request_id": stream.request_id,
            "gen_ai.usage.input_tokens": stream.num_prompt_tokens,
        },
    )
    if traced.status is not None:
        root.set_attribute("http.response.status_code", traced.status)
        if traced.status >= 500:
            root.set_status(Status(StatusCode.ERROR))
    if final is not None:  # None: the client left first, and the engine had not answered its abort yet
        root.set_attribute("gen_ai.usage.output_tokens", final.num_output_tokens)
        root.set_attribute("tokenweir.cached_tokens", final.num_cached_tokens)
        root.set_attribute("tokenweir.finish_reason", final.finish_reason or "")
    if final is not None and final.timings is not None:
        parent = set_span_in_context(root)
        for name, start, end in phases(final.timings, ended):
            tracer.start_span(name, context=parent, start_time=to_ns(start)).end(end_time=to_ns(end))
    root.end(end_time=to_ns(ended))
