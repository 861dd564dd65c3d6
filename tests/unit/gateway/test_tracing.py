"""The gateway's tracing: the `tracing` config section (off by default; an exporter that cannot run stops the start
with one line), and a request's spans (gateway/request/tracing.py RequestTrace) on a real tracer provider: the
SERVER span from the request's arrival, continuing the client's traceparent, its phases one at a time, one CLIENT
span per upstream attempt with the pool, instance and outcome, and whatever is open ended with the request."""

from __future__ import annotations

import importlib.util
import time

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.requests import Request

from tokenweir.gateway.config import BreakerConfig, TracingConfig, UpstreamConfig, load_config
from tokenweir.gateway.process.cli import load_config_or_exit
from tokenweir.gateway.request.context import RequestContext
from tokenweir.gateway.request.outcome import Outcome
from tokenweir.gateway.request.tracing import GatewayTracing, RequestTrace, gateway_tracing
from tokenweir.gateway.upstream.instance import Instance
from tokenweir.gateway.upstream.pools import Hop
from tokenweir.policies.limits import TeamLimits

OTLP_INSTALLED = importlib.util.find_spec("opentelemetry.exporter") is not None
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_off_by_default_and_then_no_tracing_at_all():
    config = load_config(env={})
    assert config.tracing == TracingConfig(enabled=False, service_name="tokenweir-gateway", exporter="none")
    assert gateway_tracing(config.tracing) is None


def test_set_from_the_env_like_every_section():
    env = {"TOKENWEIR_TRACING__ENABLED": "on", "TOKENWEIR_TRACING__EXPORTER": "console"}
    assert load_config(env=env).tracing == TracingConfig(enabled=True, exporter="console")


def test_an_unknown_exporter_is_refused_even_while_tracing_is_off():
    with pytest.raises(ValueError, match="expected none, console or otlp, got 'zipkin'"):
        TracingConfig(exporter="zipkin")


@pytest.mark.skipif(OTLP_INSTALLED, reason="the OTLP exporter is installed here")
def test_otlp_without_its_package_stops_the_start_with_one_line(capsys):
    TracingConfig(exporter="otlp")  # off: nothing is needed
    env = {"TOKENWEIR_TRACING__ENABLED": "true", "TOKENWEIR_TRACING__EXPORTER": "otlp"}
    with pytest.raises(SystemExit) as exc:
        load_config_or_exit(None, env)
    assert exc.value.code == (
        "tokenweir: configuration error: tracing: tracing exporter otlp needs the package "
        "opentelemetry-exporter-otlp-proto-http: pip install opentelemetry-exporter-otlp-proto-http"
    )


@pytest.fixture
def traced() -> tuple[GatewayTracing, InMemorySpanExporter]:
    tracing = gateway_tracing(TracingConfig(enabled=True))
    assert tracing is not None
    exporter = InMemorySpanExporter()
    tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tracing, exporter


def start(tracing: GatewayTracing, arrived: float, traceparent: str | None = TRACEPARENT) -> RequestTrace:
    headers = [(b"traceparent", traceparent.encode())] if traceparent else []
    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers})
    ctx = RequestContext(
        request_id="req-1", kind="chat", t0=arrived, team_id="team", key_id="key", model="m", limits=TeamLimits(),
        body={}, deadline_base=0.0,
    )  # fmt: skip
    return tracing.start(request, ctx, arrived)


def hop(model: str = "m", name: str = "engine-0", requested: str | None = None) -> Hop:
    return Hop(model, Instance(UpstreamConfig("http://10.1.2.3:8100", name=name), BreakerConfig()), requested)


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_request_continues_the_clients_trace_from_its_arrival(traced):
    tracing, exporter = traced
    arrived = time.perf_counter() - 0.25  # the middleware saw it a quarter second before admission
    trace = start(tracing, arrived)
    assert trace.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    trace.finish(Outcome(), 10, 3)
    spans = by_name(exporter)
    root = spans["POST /v1/chat/completions"]
    assert root.kind == SpanKind.SERVER and root.parent.span_id == 0x00F067AA0BA902B7
    assert 0.2e9 < root.end_time - root.start_time < 1e9
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["gen_ai.usage.output_tokens"] == 3
    assert spans["admission"].parent.span_id == root.context.span_id  # opened with the request, ended with it


def test_without_a_traceparent_a_new_trace():
    tracing = gateway_tracing(TracingConfig(enabled=True))
    assert tracing is not None
    one, two = start(tracing, time.perf_counter(), None), start(tracing, time.perf_counter(), None)
    assert len(one.trace_id) == 32 and one.trace_id != two.trace_id != "4bf92f3577b34da6a3ce929d0e0e4736"


def test_phases_follow_one_another_and_hops_are_client_spans_with_their_outcome(traced):
    tracing, exporter = traced
    trace = start(tracing, time.perf_counter())
    trace.phase("queue")  # ends admission
    trace.end_phase()
    trace.start_hop("hop", hop())
    sent = trace.hop_traceparent
    trace.end_hop("failed", "m@engine-0: connection failed")
    assert trace.hop_traceparent is None
    trace.end_hop("ok")  # nothing open: nothing happens
    trace.start_hop("hop", hop("other", "o-0", requested="m"))
    trace.phase("relay")
    trace.finish(Outcome("timeout", "total_timeout", 504), 10, 0)  # ends the relay and the second hop with it
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["admission", "queue", "hop", "relay", "hop", "POST /v1/chat/completions"]
    admission, queue, failed, relay, fallback, root = spans
    assert admission.end_time <= queue.start_time and queue.end_time <= relay.start_time
    assert sent is not None and sent[3:35] == trace.trace_id and int(sent[36:52], 16) == failed.context.span_id
    assert failed.kind == SpanKind.CLIENT and dict(failed.attributes) == {
        "tokenweir.pool": "m", "tokenweir.instance": "engine-0", "tokenweir.fallback": False,
        "tokenweir.outcome": "failed",
    }  # fmt: skip
    assert failed.status.status_code == StatusCode.ERROR and failed.status.description.endswith("connection failed")
    assert fallback.attributes["tokenweir.fallback"] is True and fallback.attributes["tokenweir.outcome"] == "timeout"
    assert root.status.status_code == StatusCode.ERROR and root.attributes["tokenweir.reason"] == "total_timeout"
    assert all(s.parent.span_id == root.context.span_id for s in spans[:-1])
    assert not any("10.1.2.3" in str(v) for s in spans for v in s.attributes.values())


def test_a_client_that_left_is_no_error(traced):
    tracing, exporter = traced
    trace = start(tracing, time.perf_counter())
    trace.start_hop("hop", hop())
    trace.finish(Outcome("cancelled", "client_disconnected", 499, disconnected=True), 10, 2)
    spans = by_name(exporter)
    assert spans["hop"].attributes["tokenweir.outcome"] == "cancelled"
    assert spans["hop"].status.status_code == StatusCode.UNSET
    assert spans["POST /v1/chat/completions"].status.status_code == StatusCode.UNSET
