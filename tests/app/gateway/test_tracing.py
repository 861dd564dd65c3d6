"""Tracing through the gateway and the engine, in this process (a tiny random Llama with a byte tokenizer, so chats
run): one in-memory exporter takes the spans of both sides. A chat with the client's `traceparent` makes one trace
under it: the gateway's SERVER span -> admission, queue, hop (-> the engine's SERVER span -> queue, prefill, decode)
and, for a stream, relay; its event's trace_id is the client's. Without a traceparent the gateway starts the trace
and the engine continues it. A hop that fails is a span of its own (outcome failed), the fallback that serves the
request another; a disaggregated pool's prefill member is a `prefill_hop` before the decode `hop`, each engine's spans
under its own; no span names an upstream's address. With tracing off (a fresh interpreter), no tokenweir module
imports opentelemetry and events carry no trace_id."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.support.events import the_event
from tests.support.kv_transfer import KV_KEY
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.tiny_llama import add_byte_tokenizer, make_tiny_llama
from tokenweir.engine.api import build_app
from tokenweir.engine.config import EngineConfig, KVTransferConfig
from tokenweir.engine.core.async_engine import AsyncEngine
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, TracingConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
HELLO = [{"role": "user", "content": "Say hello to the gateway"}]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracing")
    model = add_byte_tokenizer(make_tiny_llama(str(tmp / "tiny"), seed=3, vocab_size=260, max_position_embeddings=512))
    config = EngineConfig(model=model, served_model_name="tiny", num_kv_blocks=64, quantization="none", dtype="float32")
    producer, consumer = (
        replace(config, kv_transfer=KVTransferConfig(kv_role=r, transfer_key=KV_KEY))
        for r in ("kv_producer", "kv_consumer")
    )
    exporter = InMemorySpanExporter()
    engine_provider = TracerProvider()
    engine_provider.add_span_processor(SimpleSpanProcessor(exporter))
    store = Store.open(f"sqlite:///{tmp}/store.db")
    team = store.create_team("t", TeamLimits())
    secret, _ = store.create_key(team.id, "k")
    dead = f"http://127.0.0.1:{closed_port()}"

    def export_gateway_spans(services) -> None:
        services.path.tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))

    def traced_engine(config: EngineConfig) -> ServerThread:
        return ServerThread(build_app(AsyncEngine(LLMEngine(config)), tracer_provider=engine_provider))

    with traced_engine(config) as eng, traced_engine(producer) as pre, traced_engine(consumer) as dec:
        split = [
            UpstreamConfig(pre.url, name="prefill", role="prefill", model="tiny"),
            UpstreamConfig(dec.url, name="decode", role="decode", model="tiny"),
        ]
        gateway = GatewayConfig(
            port=0,
            pools=[
                PoolConfig(model="tiny", upstreams=[UpstreamConfig(eng.url, name="e")]),
                # every hop of this pool fails (connection refused): its fallback serves the request
                PoolConfig(model="down", upstreams=[UpstreamConfig(dead, name="gone")], fallbacks=["tiny"]),
                PoolConfig(model="split", upstreams=split),  # disaggregated: a prefill hop, then a decode hop
            ],
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            tracing=TracingConfig(enabled=True),
        )
        with serve_app(gateway, store=store, on_started=export_gateway_spans) as gw:
            yield {
                "url": gw.url,
                "events": tmp / "events.jsonl",
                "auth": {"authorization": f"Bearer {secret}"},
                "exporter": exporter,
                "addresses": (eng.url, pre.url, dec.url, dead, "127.0.0.1"),
            }
    store.close()


def chat(stack, stream: bool, model: str = "tiny", traceparent: str | None = TRACEPARENT) -> httpx.Response:
    stack["exporter"].clear()  # the spans of earlier tests' requests (the client's trace id is everyone's here)
    headers = dict(stack["auth"]) | ({"traceparent": traceparent} if traceparent else {})
    body = {"model": model, "messages": HELLO, "max_tokens": 6, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(stack["url"] + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r


def trace_spans(exporter: InMemorySpanExporter, trace_id: str, servers: int = 2) -> list[ReadableSpan]:
    """The trace's spans once its SERVER spans (the gateway's and each engine's: each ends after its answer) are in."""
    deadline = time.monotonic() + 10
    while True:
        spans = [s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]
        if sum(s.kind == SpanKind.SERVER for s in spans) >= servers or time.monotonic() > deadline:
            return spans
        time.sleep(0.02)


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id),
                  key=lambda s: s.start_time)  # fmt: skip


def one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    (span,) = [s for s in spans if s.name == name]
    return span


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_is_one_trace_under_the_clients_span(stack, stream):
    r = chat(stack, stream)
    spans = trace_spans(stack["exporter"], CLIENT_TRACE)
    (gateway,) = [s for s in spans if s.parent.span_id == int(CLIENT_SPAN, 16)]
    assert gateway.kind == SpanKind.SERVER and gateway.name == "POST /v1/chat/completions" and gateway.parent.is_remote
    assert gateway.attributes["http.response.status_code"] == 200
    assert gateway.attributes["tokenweir.request_id"] == r.headers["x-request-id"]
    steps = children(spans, gateway)
    assert [s.name for s in steps] == ["admission", "queue", "hop", *(["relay"] if stream else [])]
    hop = one(steps, "hop")
    assert hop.kind == SpanKind.CLIENT
    assert dict(hop.attributes) == {
        "tokenweir.pool": "tiny", "tokenweir.instance": "e", "tokenweir.fallback": False, "tokenweir.outcome": "ok"
    }  # fmt: skip
    # the engine continued the hop's traceparent
    (engine,) = children(spans, hop)
    assert engine.kind == SpanKind.SERVER and engine.name == "POST /v1/chat/completions"
    phases = children(spans, engine)
    assert [s.name for s in phases] == ["queue", "prefill", "decode"]
    for earlier, later in zip(phases, phases[1:], strict=False):
        assert earlier.end_time <= later.start_time
    assert engine.start_time <= phases[0].start_time and phases[-1].end_time <= engine.end_time
    assert hop.start_time <= engine.start_time  # (its end may follow the gateway's: after [DONE] went out)
    event = the_event(stack["events"], r.headers["x-request-id"])
    assert event["trace_id"] == CLIENT_TRACE
    assert engine.attributes["tokenweir.request_id"] == event["upstream_request_id"]
    assert engine.attributes["gen_ai.usage.output_tokens"] == event["completion_tokens"] > 0
    assert gateway.attributes["gen_ai.usage.output_tokens"] == event["completion_tokens"]
    assert {f"{s.context.trace_id:032x}" for s in spans} == {CLIENT_TRACE}
    assert len(spans) == len(steps) + len(phases) + 2  # nothing else in the trace: every span is in the tree


def test_without_a_traceparent_the_gateway_starts_the_trace_the_engine_continues(stack):
    r = chat(stack, stream=False, traceparent=None)
    event = the_event(stack["events"], r.headers["x-request-id"])
    assert len(event["trace_id"]) == 32 and event["trace_id"] != CLIENT_TRACE
    spans = trace_spans(stack["exporter"], event["trace_id"])
    (gateway,) = [s for s in spans if s.parent is None]
    servers = [s for s in spans if s.kind == SpanKind.SERVER]
    assert len(servers) == 2 and gateway in servers
    (engine,) = [s for s in servers if s is not gateway]
    assert engine.parent.span_id == one(spans, "hop").context.span_id


def test_a_failed_hop_and_the_fallback_that_serves_it_are_spans_of_their_own(stack):
    r = chat(stack, stream=True, model="down")
    spans = trace_spans(stack["exporter"], CLIENT_TRACE)
    (gateway,) = [s for s in spans if s.parent.span_id == int(CLIENT_SPAN, 16)]
    failed, served = [s for s in children(spans, gateway) if s.name == "hop"]
    assert failed.attributes["tokenweir.pool"] == "down" and failed.attributes["tokenweir.instance"] == "gone"
    assert failed.attributes["tokenweir.outcome"] == "failed" and not failed.status.is_ok
    assert "connection failed" in failed.status.description
    assert children(spans, failed) == []  # nothing answered it
    assert served.attributes["tokenweir.fallback"] is True and served.attributes["tokenweir.outcome"] == "ok"
    assert [s.name for s in children(spans, served)] == ["POST /v1/chat/completions"]
    assert the_event(stack["events"], r.headers["x-request-id"])["trace_id"] == CLIENT_TRACE
    # tenants may read traces: pool and instance names only, never where an upstream lives
    for span in spans:
        for value in [*span.attributes.values(), span.status.description or ""]:
            assert not any(address in str(value) for address in stack["addresses"]), (span.name, value)


def test_a_disaggregated_pools_prefill_hop_is_a_span_of_its_own_and_both_engines_continue_the_trace(stack):
    r = chat(stack, stream=False, model="split")
    spans = trace_spans(stack["exporter"], CLIENT_TRACE, servers=3)
    (gateway,) = [s for s in spans if s.parent.span_id == int(CLIENT_SPAN, 16)]
    steps = children(spans, gateway)
    assert [s.name for s in steps] == ["admission", "queue", "prefill_hop", "hop"]
    prefill, decode = steps[2:]
    assert dict(prefill.attributes) == {
        "tokenweir.pool": "split", "tokenweir.instance": "prefill", "tokenweir.fallback": False,
        "tokenweir.outcome": "ok",
    }  # fmt: skip
    assert decode.attributes["tokenweir.instance"] == "decode" and prefill.end_time <= decode.start_time
    for hop in (prefill, decode):
        (engine,) = children(spans, hop)
        assert [s.name for s in children(spans, engine)] == ["queue", "prefill", "decode"]
    event = the_event(stack["events"], r.headers["x-request-id"])
    assert (event["prefill_instance"], event["trace_id"]) == ("split@prefill", CLIENT_TRACE)


# Both apps built and one request served through them, in a fresh interpreter; it prints which opentelemetry
# modules a tokenweir module imported (an import hook sees each import statement, a function's lazy ones too),
# whether the tracing SDK is loaded, and the request's event's trace_id. FastAPI and redis import parts of
# opentelemetry themselves, so what counts is who imports, not whether anything is loaded.
PROBE = """
import builtins, json, sys, tempfile
import httpx

by_tokenweir = set()
real_import = builtins.__import__

def noting_import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__", "")
    if name.startswith("opentelemetry") and importer.startswith("tokenweir"):
        by_tokenweir.add(importer + " -> " + name)
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = noting_import

from tests.support.serve_thread import ServerThread, serve_app
from tests.support.tiny_llama import make_tiny_llama
from tokenweir.engine.api import build_app
from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.async_engine import AsyncEngine
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, TracingConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

tracing = sys.argv[1] == "on"  # argv[2]: the client's traceparent
tmp = tempfile.mkdtemp()
engine = LLMEngine(EngineConfig(model=make_tiny_llama(tmp + "/tiny"), served_model_name="tiny", num_kv_blocks=32))
store = Store.open(f"sqlite:///{tmp}/store.db")
secret, _ = store.create_key(store.create_team("t", TeamLimits()).id, "k")
provider = None
if tracing:
    from opentelemetry.sdk.trace import TracerProvider
    provider = TracerProvider()
with ServerThread(build_app(AsyncEngine(engine), tracer_provider=provider)) as eng:
    config = GatewayConfig(
        port=0,
        pools=[PoolConfig(model="tiny", upstreams=[UpstreamConfig(eng.url)])],
        events=EventsConfig(path=tmp + "/events.jsonl"),
        tracing=TracingConfig(enabled=tracing),
    )
    with serve_app(config, store=store) as gw:
        body = {"model": "tiny", "prompt": [5, 17, 42], "max_tokens": 3}
        auth = {"authorization": "Bearer " + secret, "traceparent": sys.argv[2]}
        r = httpx.post(gw.url + "/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
(event,) = read_events(tmp + "/events.jsonl")
print(json.dumps({"by_tokenweir": sorted(by_tokenweir), "sdk_trace": "opentelemetry.sdk.trace" in sys.modules,
                  "trace_id": event["trace_id"]}), flush=True)
# What this probe measures is said; skip the interpreter's teardown, where torch's worker threads may still be
# unwinding (a CI run of 1,700 tests saw one std::terminate there: exit -6 after the answer was printed)
import os
os._exit(0)
"""


@pytest.mark.parametrize("tracing", ["off", "on"])
def test_with_tracing_off_nothing_of_opentelemetry_is_imported_and_events_have_no_trace_id(tracing):
    """Off, the request path imports no opentelemetry and its event says no trace; on (the same probe), it does:
    the probe can tell."""
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, tracing, TRACEPARENT],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if tracing == "off":
        assert seen == {"by_tokenweir": [], "sdk_trace": False, "trace_id": None}
    else:
        assert seen["sdk_trace"] and seen["trace_id"] == CLIENT_TRACE
        importers = {line.split(" -> ")[0] for line in seen["by_tokenweir"]}
        assert {
            "tokenweir.common.tracing",
            "tokenweir.gateway.request.tracing",
            "tokenweir.engine.api.tracing",
        } <= importers
