"""The engine's API key, over real HTTP on the tiny random Llama: every route but /health and /metrics refuses a call
without the key or with a wrong one (a 401 `invalid_api_key`, OpenAI's shape), /abort included, so a local process can
neither be served around the gateway nor stop another tenant's request; `python -m engine.server` takes the key from
TOKENWEIR_ENGINE_API_KEY as well as from --api-key."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import uvicorn
from fastapi.routing import APIRoute

from tokenweir.common.engine_flags import API_KEY_ENV
from tokenweir.engine.api import build_app
from tokenweir.engine.api.routes import router
from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.async_engine import AsyncEngine
from tokenweir.engine.core.llm_engine import LLMEngine

KEY = "s3cret-engine-key"
OPEN = {"/health", "/metrics"}
PROMPT = [5, 17, 42, 99, 3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def served(tiny_model_dir):
    """uvicorn on a free port serving the engine's app with KEY; yields (base url, the app)."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64, num_threads=1, quantization="none"))
    app = build_app(AsyncEngine(engine), api_key=KEY)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        await task
        sock.close()


def assert_refused(r: httpx.Response, what: str) -> None:
    assert r.status_code == 401, f"{what}: {r.status_code} {r.text[:200]}"
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key"), what
    assert KEY not in r.text
    assert r.headers.get("x-request-id"), "a refusal still carries its request id"


async def test_every_route_but_health_and_metrics_refuses_a_missing_or_wrong_key(served):
    url, _ = served
    routes = [(m, r.path) for r in router.routes if isinstance(r, APIRoute) for m in r.methods]
    routes += [("GET", "/docs"), ("GET", "/openapi.json")]  # FastAPI's own pages name every route
    paths = {p for _, p in routes}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/abort", "/load", "/tokenize"} <= paths
    assert paths >= OPEN
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for method, path in routes:
            body = {"model": "x", "prompt": PROMPT, "request_id": "r"} if method == "POST" else None
            wrongs = {
                "no key": {},
                "wrong key": {"authorization": f"Bearer {KEY}x"},
                "key cut short": {"authorization": f"Bearer {KEY[:-1]}"},
                "not a bearer": {"authorization": KEY},
            }
            for what, headers in wrongs.items():
                r = await client.request(method, path, json=body, headers=headers)
                if path in OPEN:
                    assert r.status_code == 200, f"{method} {path} ({what}): probes need no key"
                else:
                    assert_refused(r, f"{method} {path} ({what})")
        # unknown paths too: the key is checked before routing
        assert_refused(await client.get("/v2/anything"), "unknown path")
        auth = {"authorization": f"Bearer {KEY}"}
        models = await client.get("/v1/models", headers=auth)
        assert models.status_code == 200
        r = await client.post(
            "/v1/completions",
            json={"model": models.json()["data"][0]["id"], "prompt": PROMPT, "max_tokens": 2},
            headers={"authorization": f"bearer {KEY}"},  # the scheme is case-insensitive (RFC 9110)
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert (await client.get("/load", headers=auth)).json()["num_running"] == 0


async def test_abort_of_someone_elses_request_needs_the_key(served):
    url, _ = served
    auth = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        model = (await client.get("/v1/models", headers=auth)).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 800, "ignore_eos": True, "stream": True}
        async with client.stream(
            "POST", "/v1/completions", json=body, headers={**auth, "x-request-id": "victim"}
        ) as stream:
            lines = stream.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
            for headers in ({}, {"authorization": "Bearer guess"}):
                assert_refused(await client.post("/abort", json={"request_id": "victim"}, headers=headers), "abort")
            assert (await client.get("/load", headers=auth)).json()["num_running"] == 1, "the stream runs on"
            r = await client.post("/abort", json={"request_id": "victim"}, headers=auth)
            assert r.status_code == 200 and r.json()["status"] == "aborted"


def test_python_m_engine_server_takes_the_key_from_its_env(tiny_model_dir):
    """The env variable (what `tokenweir serve` gives its children: argv is visible to `ps`) guards the server."""
    port = free_port()
    args = ["--model", tiny_model_dir, "--port", str(port), "--num-kv-blocks", "32", "--num-threads", "1"]
    env = {**os.environ, API_KEY_ENV: KEY}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenweir.engine.server", *args, "--log-level", "warning"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the server exited: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert_refused(httpx.get(f"{url}/v1/models"), "models without the key")
        assert_refused(httpx.post(f"{url}/abort", json={"request_id": "x"}), "abort without the key")
        assert httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
