"""A poison request through `tokenweir serve --engines 2`, for real: response_formats whose grammars hit the parser's
limits part-way get a 400 naming `response_format` (one engine tried, never the next), while another team's stream
keeps getting tokens, both engines stay up (same processes, healthy) and every request has its one event."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import openai
import pytest

from gateway.events import read_events
from loadtests.fake_upstream import free_port
from tests.engine.test_request_failures import POISON_SCHEMAS, response_format
from tests.serve_process import serve_process
from tests.test_serve_engines import MODEL, Output, stop_serve, wait_for

pytestmark = pytest.mark.slow


def test_poison_grammars_fail_alone_while_another_teams_stream_goes_on(tmp_path):
    events_path = tmp_path / "events.jsonl"
    args = ["--port", str(free_port()), "--engine-port", str(free_port()), "--engines", "2"]
    args += ["--store", f"sqlite:///{tmp_path / 'tw.db'}"]
    env = {"TOKENWEIR_EVENTS__PATH": str(events_path), "TOKENWEIR_ENGINE__EXTRA_ARGS": '["--quantization", "none"]'}
    with serve_process(args, env, timeout_s=240) as served:
        out = Output(served.proc, served.output)
        try:
            _exercise(served, out, events_path)
        finally:
            stop_serve(served, out)


def _exercise(served, out: Output, events_path) -> None:
    engines_before = out.engines()
    assert sorted(engines_before) == [0, 1], out.read()
    admin = httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {served.admin_key}"}, timeout=30)
    team = admin.post("/admin/teams", json={"name": "poisoner"}).json()
    poisoner_key = admin.post(f"/admin/teams/{team['id']}/keys", json={"name": "p"}).json()["secret"]
    bystander = openai.OpenAI(base_url=served.url + "/v1", api_key=served.demo_key, max_retries=0, timeout=120)
    poisoner = openai.OpenAI(base_url=served.url + "/v1", api_key=poisoner_key, max_retries=0, timeout=120)

    # Another team's long stream, read on a thread: token arrival times.
    arrivals: list[float] = []
    stream_done = threading.Event()

    def read_stream() -> None:
        stream = bystander.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=160, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.monotonic())
        stream_done.set()

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    wait_for("the bystander's first tokens", lambda: len(arrivals) >= 3, 60)

    refused: list[str] = []
    poison_started = time.monotonic()
    for name, schema in POISON_SCHEMAS.items():
        for seed in range(8):
            rid = f"poison-{name}-{seed}-{uuid.uuid4().hex[:6]}"
            try:
                poisoner.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Write a JSON object."}],
                    response_format=response_format(schema), temperature=1.0, seed=seed, max_tokens=64,
                    stream=seed % 2 == 1, extra_headers={"x-request-id": rid},
                )  # fmt: skip
            except openai.BadRequestError as e:
                error = e.body if isinstance(e.body, dict) and "code" in e.body else e.body.get("error", {})
                assert error["code"] == "invalid_response_format" and error["param"] == "response_format", e.body
                refused.append(rid)
    poison_ended = time.monotonic()
    assert refused, "no poison request was refused"

    # The bystander kept getting tokens while the poison requests ran, and finished.
    assert any(poison_started <= t <= poison_ended for t in arrivals), "the bystander's stream stalled"
    assert stream_done.wait(120) and len(arrivals) >= 150, len(arrivals)

    # Both engines are the same processes, healthy, and serve the next request.
    assert out.engines() == engines_before, out.read()
    for _, url in engines_before.values():
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    again = bystander.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=4, temperature=0
    )
    assert again.choices[0].message.content

    # One event each; a refused poison request tried one engine only, and is billed what the engine counted.
    def refused_events() -> list[dict] | None:
        found = {e["request_id"]: e for e in read_events(events_path)}
        return [found[rid] for rid in refused] if all(rid in found for rid in refused) else None

    for event in wait_for("the poison requests' events", refused_events, 20):
        assert event["status"] == "error" and event["http_status"] == 400, event
        assert len(event["route"]) == 1, event
    assert "Traceback" not in out.read()
