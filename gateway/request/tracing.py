"""Traces of admitted requests (OpenTelemetry; `tracing.enabled` in the config, off by default).

A request's trace continues the W3C `traceparent` its client sent (else it starts one): a SERVER span from its
arrival to its end, and under it the phases it goes through one after another (`admission`, `queue`: waiting for a
dispatch slot, `relay`: a stream's answer sent back) and one CLIENT span per upstream attempt (`prefill_hop` for a
disaggregated pool's prefill member, `hop` for each hop of the route plan), whose `traceparent` the upstream gets,
so an engine's spans hang under the hop that called it. The trace id is the request's event's `trace_id`.

Off, the app has no GatewayTracing and a request's `trace` is None: each hook on the request path is one `is None`
test, and nothing of opentelemetry is imported (every import of it is inside a function that only tracing calls).
Spans name the pool and the instance of a hop, never its address (a tenant may be the one who reads the trace).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tokenweir.common.tracing import epoch_ns, make_provider, parent_context, trace_id_of, traceparent_of
from tokenweir.gateway.accounting.request_event import clip
from tokenweir.gateway.config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer
    from starlette.requests import HTTPConnection

    from tokenweir.gateway.request.context import RequestContext
    from tokenweir.gateway.request.outcome import Outcome
    from tokenweir.gateway.upstream.pools import Hop

TRACER_NAME = "tokenweir.gateway"
# Hop outcomes that are no fault: the request went on, or its client left
_NOT_ERRORS = frozenset({"ok", "cancelled"})


class GatewayTracing:
    """The app's tracer provider (the config's exporter) and the start of each admitted request's trace."""

    def __init__(self, config: TracingConfig) -> None:
        self.provider: TracerProvider = make_provider(config.service_name, config.exporter, config.endpoint)
        self.tracer: Tracer = self.provider.get_tracer(TRACER_NAME)

    def start(self, request: HTTPConnection, ctx: RequestContext, arrived: float) -> RequestTrace:
        """The request's SERVER span, from `arrived` (its perf_counter arrival), and its admission phase, now."""
        from opentelemetry.trace import SpanKind

        method, path = request.scope["method"], request.scope["path"]
        root = self.tracer.start_span(
            f"{method} {path}",
            context=parent_context(request.headers.get("traceparent")),
            kind=SpanKind.SERVER,
            start_time=epoch_ns(time.perf_counter)(arrived),
            attributes={
                "http.request.method": method,
                "url.path": path,
                "tokenweir.request_id": ctx.request_id,
                "tokenweir.team": ctx.team_id,
                "gen_ai.request.model": clip(ctx.model) or "",
                "tokenweir.stream": ctx.stream,
            },
        )
        trace = RequestTrace(self.tracer, root)
        trace.phase("admission")
        return trace


def gateway_tracing(config: TracingConfig) -> GatewayTracing | None:
    """The app's tracing; None when it is off."""
    return GatewayTracing(config) if config.enabled else None


class RequestTrace:
    """One admitted request's spans (its RequestContext's `trace`): the SERVER span, the phase running now (one at a
    time), and the upstream attempt open now (one at a time), both the SERVER span's children. `finish`, at the
    request's one end, ends whatever is still open, then the SERVER span."""

    __slots__ = ("tracer", "root", "parent", "trace_id", "phase_span", "hop_span", "hop_traceparent")

    def __init__(self, tracer: Tracer, root: Span) -> None:
        from opentelemetry.trace import set_span_in_context

        self.tracer, self.root = tracer, root
        self.parent = set_span_in_context(root)
        self.trace_id = trace_id_of(root)
        self.phase_span: Span | None = None
        self.hop_span: Span | None = None
        self.hop_traceparent: str | None = None  # the open attempt's, for the upstream's `traceparent` header

    def phase(self, name: str) -> None:
        """End the phase running now, if any, and start `name`."""
        self.end_phase()
        self.phase_span = self.tracer.start_span(name, context=self.parent)

    def end_phase(self) -> None:
        span, self.phase_span = self.phase_span, None
        if span is not None:
            span.end()

    def start_hop(self, name: str, hop: Hop) -> None:
        """A CLIENT span for an attempt at `hop`; `hop_traceparent` names it for the upstream."""
        from opentelemetry.trace import SpanKind

        self.end_hop("abandoned")  # never left open by the request path; a guard, so no span leaks
        span = self.hop_span = self.tracer.start_span(
            name,
            context=self.parent,
            kind=SpanKind.CLIENT,
            attributes={
                "tokenweir.pool": hop.model,
                "tokenweir.instance": hop.instance.name,
                "tokenweir.fallback": hop.fallback,
            },
        )
        self.hop_traceparent = traceparent_of(span)

    def end_hop(self, outcome: str, why: str | None = None) -> None:
        """End the open attempt, if any: `outcome` ok | failed (the next hop may serve it) | rejected | no_kv (a
        prefill member that kept no KV) | the request's own outcome where it ended with this hop (timeout, error,
        cancelled); `why`, a failure's tenant-safe words (pool and instance names, never an address)."""
        span, self.hop_span, self.hop_traceparent = self.hop_span, None, None
        if span is None:
            return
        span.set_attribute("tokenweir.outcome", outcome)
        if outcome not in _NOT_ERRORS and outcome != "no_kv":
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, why or outcome))
        span.end()

    def finish(self, outcome: Outcome, prompt_tokens: int, completion_tokens: int) -> None:
        """The request's end: what is still open ends with it, then the SERVER span, with how the request ended."""
        self.end_phase()
        self.end_hop(outcome.status)
        root = self.root
        root.set_attribute("http.response.status_code", outcome.http_status)
        root.set_attribute("tokenweir.outcome", outcome.status)
        if outcome.reason is not None:
            root.set_attribute("tokenweir.reason", outcome.reason)
        root.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        root.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        if outcome.http_status >= 500:
            from opentelemetry.trace import Status, StatusCode

            root.set_status(Status(StatusCode.ERROR, outcome.reason))
        root.end()
