"""The README's main command, for real: `tokenweir serve` starts the gateway and a bundled engine child on SmolLM2.
One serve process for the module (its start is most of the cost); the test that stops it runs last.

Its engine child takes a random key made at start, in its env (not its command line, which `ps` shows every local
user), and refuses keyless callers on every route but the probes, /abort included, while the gateway serves through
it; the serve process's tenant-facing answers name no address.

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

from loadtests.fake_upstream import free_port
from tests.support.serve_process import serve_process
from tokenweir.common.engine_flags import API_KEY_ENV
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.store.store import Store

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
MODEL = "smollm2-135m"


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


def engine_children(parent: int) -> list[int]:
    """Pids of `parent`'s children that run engine.server."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"tokenweir.engine.server" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    engine_port = free_port()
    args = ["--port", str(free_port()), "--engine-port", str(engine_port), "--store", f"sqlite:///{tmp / 'tw.db'}"]
    env = {
        "TOKENWEIR_EVENTS__PATH": str(tmp / "events.jsonl"),
        "TOKENWEIR_USAGE_FLUSH_INTERVAL_S": "600",  # only the SIGTERM flush may write usage: it is under test
        API_KEY_ENV: None,  # serve passes its env on: the engine's key must be its own choice
    }
    with serve_process(args, env, timeout_s=240) as served:
        (pid,) = engine_children(served.proc.pid)
        environ = dict(
            item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
        )
        try:
            yield {
                "url": served.url,
                "engine": f"http://127.0.0.1:{engine_port}",
                "engine_pid": pid,
                "engine_key": environ[API_KEY_ENV.encode()].decode(),  # this module reads the engine's /load
                "proc": served.proc,
                "output": served.output,
                "admin": served.admin_key,
                "tmp": tmp,
                "demo": served.demo_key,
            }
        finally:
            if served.proc.poll() is None:  # the books test did not run: stop it as it would, engine child included
                served.proc.send_signal(signal.SIGTERM)
                served.proc.wait(timeout=60)


def test_serves_through_an_engine_child_that_refuses_keyless_callers(served):
    client = openai.OpenAI(base_url=served["url"] + "/v1", api_key=served["demo"], max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=3, temperature=0
    )
    assert chat.usage.completion_tokens >= 1

    engine, key = served["engine"], served["engine_key"]
    argv = Path(f"/proc/{served['engine_pid']}/cmdline").read_bytes().split(b"\0")
    assert b"--api-key" not in argv and not any(a.startswith(b"--api-key=") for a in argv)
    assert len(key) >= 32 and key not in served["output"], "the key is never printed"

    for method, path, body in (
        ("GET", "/v1/models", None),
        ("GET", "/load", None),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/abort", {"request_id": "someone-elses"}),
    ):
        r = httpx.request(method, engine + path, json=body, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", f"{method} {path}: {r.text}"
    assert httpx.get(engine + "/health", timeout=10).status_code == 200
    assert httpx.get(engine + "/metrics", timeout=10).status_code == 200
    assert httpx.get(engine + "/v1/models", headers={"authorization": f"Bearer {key}"}).status_code == 200

    health = httpx.get(served["url"] + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["checks"][f"pool:{MODEL}"] == "ok"
    assert "127.0.0.1" not in health.text and "http://" not in health.text
    detail = httpx.get(served["url"] + "/health", headers={"authorization": f"Bearer {served['admin']}"}, timeout=10)
    assert detail.json()["pools"][MODEL][0]["base_url"] == engine


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
        load = httpx.get(served["engine"] + "/load", headers={"authorization": f"Bearer {served['engine_key']}"}).json()
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
