"""The README's main command, for real: `tokenweir serve` starts the gateway and a bundled engine child on SmolLM2.

Through the `openai` SDK: chat non-stream and stream, a stream the client drops halfway, an over-long prompt, an
unknown model, a bad key. Then the accounting invariant across all three books: the gateway's JSONL events, the
usage rows in its store and the engine's own Prometheus counters agree token for token, and every KV block is free.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.events import read_events
from gateway.store import Store
from loadtests.fake_upstream import free_port
from tests.serve_process import serve_process

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
ENGINE_KEY = "e2e-engine-key"


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    engine_port = free_port()
    args = ["--port", str(free_port()), "--engine-port", str(engine_port), "--store", f"sqlite:///{tmp / 'tw.db'}"]
    env = {
        "TOKENWEIR_EVENTS__PATH": str(tmp / "events.jsonl"),
        "TOKENWEIR_USAGE_FLUSH_INTERVAL_S": "600",  # only the SIGTERM flush may write usage: it is under test
        "TOKENWEIR_ENGINE_API_KEY": ENGINE_KEY,  # the engine's key (else a random one): this test reads its /load
    }
    with serve_process(args, env, timeout_s=240) as served:
        yield {
            "url": served.url,
            "engine": f"http://127.0.0.1:{engine_port}",
            "proc": served.proc,
            "tmp": tmp,
            "demo": served.demo_key,
        }


def test_openai_sdk_through_gateway_and_exact_books(served):
    client = openai.OpenAI(base_url=served["url"] + "/v1", api_key=served["demo"], max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.completion_tokens == 12 or chat.choices[0].finish_reason == "stop"

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens

    # A client that walks away mid-stream: the engine stops, and what it made is billed.
    dropped = client.completions.create(
        model=MODEL, prompt="Count slowly from one to one hundred:", max_tokens=200, temperature=0, stream=True
    )
    for i, _ in enumerate(dropped):
        if i == 4:
            break
    dropped.close()

    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=5)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served["url"] + "/v1", api_key="tw-wrong", max_retries=0).models.list()

    # Settle: the dropped stream's abort reaches the engine, then every block must be free again.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        load = httpx.get(served["engine"] + "/load", headers={"authorization": f"Bearer {ENGINE_KEY}"}).json()
        if load["num_running"] == 0 and load["num_free_blocks"] == load["num_total_blocks"]:
            break
        time.sleep(0.2)
    assert load["num_running"] == 0 and load["num_free_blocks"] == load["num_total_blocks"], load
    engine_metrics = httpx.get(served["engine"] + "/metrics").text

    proc = served["proc"]
    proc.send_signal(signal.SIGTERM)  # the gateway flushes usage and events on the way out
    proc.wait(timeout=60)

    events = read_events(served["tmp"] / "events.jsonl")
    billed = [e for e in events if e["status"] != "rejected"]
    assert {e["reason"] for e in events if e["status"] == "rejected"} >= {"too_long"}
    assert sum(e["client_disconnected"] for e in billed) == 1
    store = Store.open(f"sqlite:///{served['tmp'] / 'tw.db'}")
    try:
        rows = store.usage()
    finally:
        store.close()
    books = {
        "events": (sum(e["prompt_tokens"] for e in billed), sum(e["completion_tokens"] for e in billed)),
        "store": (sum(r.prompt_tokens for r in rows), sum(r.completion_tokens for r in rows)),
        "engine": (
            int(metric(engine_metrics, "tokenweir:prompt_tokens_total")),
            int(metric(engine_metrics, "tokenweir:generation_tokens_total")),
        ),
    }
    assert books["events"] == books["store"] == books["engine"], books
    dropped_event = next(e for e in billed if e["client_disconnected"])
    assert 4 <= dropped_event["completion_tokens"] < 200
