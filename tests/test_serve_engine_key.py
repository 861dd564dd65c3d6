"""`tokenweir serve` for real, on SmolLM2: its engine child takes a random key made at start, in its env (not its
command line, which `ps` shows every local user), and refuses keyless callers on every route but the probes, /abort
included, while the gateway serves through it. The serve process's tenant-facing answers name no address."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import openai
import pytest

from engine.flags import API_KEY_ENV
from loadtests.fake_upstream import free_port
from tests.serve_process import serve_process

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"


def engine_children(parent: int) -> list[int]:
    """Pids of `parent`'s children that run engine.server."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"engine.server" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def test_serves_through_an_engine_child_that_refuses_keyless_callers(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)  # serve passes its env on: the key must be its own choice
    engine_port = free_port()
    args = ["--port", str(free_port()), "--engine-port", str(engine_port), "--store", f"sqlite:///{tmp_path / 't.db'}"]
    env = {"TOKENWEIR_EVENTS__PATH": str(tmp_path / "events.jsonl")}
    with serve_process(args, env, timeout_s=240) as served:
        try:
            _exercise(served, f"http://127.0.0.1:{engine_port}")
        finally:
            served.proc.send_signal(signal.SIGTERM)
            served.proc.wait(timeout=60)


def _exercise(served, engine: str) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=served.demo_key, max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=3, temperature=0
    )
    assert chat.usage.completion_tokens >= 1

    (pid,) = engine_children(served.proc.pid)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"--api-key" not in argv and not any(a.startswith(b"--api-key=") for a in argv)
    environ = dict(
        item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
    )
    key = environ[API_KEY_ENV.encode()].decode()
    assert len(key) >= 32 and key not in served.output, "the key is never printed"

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

    health = httpx.get(served.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["checks"][f"pool:{MODEL}"] == "ok"
    assert "127.0.0.1" not in health.text and "http://" not in health.text
    detail = httpx.get(served.url + "/health", headers={"authorization": f"Bearer {served.admin_key}"}, timeout=10)
    assert detail.json()["pools"][MODEL][0]["base_url"] == engine
