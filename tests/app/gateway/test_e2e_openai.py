"""The `openai` SDK against the gateway served by uvicorn, in front of the fake upstream, over real HTTP."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

MODEL = "fake-model"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """fake upstream + store + gateway; each test makes its own team (limits differ, caches stay honest)."""
    tmp = tmp_path_factory.mktemp("e2e")
    fake = FakeUpstream(model=MODEL)
    store = Store.open(f"sqlite:///{tmp}/store.db")
    with ServerThread(fake) as upstream:
        config = GatewayConfig(
            port=0,
            pools=[
                PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream.url)], max_context=4096),
                PoolConfig(model="other-model", upstreams=[UpstreamConfig(upstream.url, model=MODEL)]),
            ],
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
            max_body_bytes=64 * 1024,
        )
        with serve_app(config, store=store) as gw:
            yield {"fake": fake, "store": store, "url": gw.url, "events": tmp / "events.jsonl", "app": gw.app}
    store.close()


def team_client(stack, limits: TeamLimits = TeamLimits(), name: str | None = None):
    team = stack["store"].create_team(name or f"team-{time.monotonic_ns()}", limits)
    secret, _ = stack["store"].create_key(team.id, "test")
    client = openai.AsyncOpenAI(base_url=stack["url"] + "/v1", api_key=secret, max_retries=0)
    return team, secret, client


def wait_events(stack, predicate, timeout=5.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        events = [e for e in read_events(stack["events"]) if predicate(e)]
        if events or time.monotonic() > deadline:
            return events
        time.sleep(0.02)


HELLO = [{"role": "user", "content": "Say hello to the gateway"}]


async def test_chat_non_stream(stack):
    team, _, client = team_client(stack)
    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=5)
    resp = raw.parse()
    assert resp.choices[0].message.content == "tok " * 5
    assert resp.usage.completion_tokens == 5
    assert resp.usage.prompt_tokens == 6  # the fake's rule: 5 words + 1 per message
    rid = raw.headers["x-request-id"]
    (event,) = wait_events(stack, lambda e: e["request_id"] == rid)
    assert event["team"] == team.id and event["status"] == "ok" and event["http_status"] == 200
    assert (event["prompt_tokens"], event["completion_tokens"], event["max_tokens"]) == (6, 5, 5)
    assert event["route"] == [f"{MODEL}@{stack['fake'] and event['instance'].split('@')[1]}"]
    assert event["stream"] is False and event["finish_reason"] == "length"


async def test_chat_stream_keeps_chunks_and_drops_usage_not_asked_for(stack):
    _, _, client = team_client(stack)
    stream = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok " * 4
    assert all(c.usage is None for c in chunks), "usage the gateway asked for itself must not reach the client"
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_chat_stream_with_include_usage(stack):
    _, _, client = team_client(stack)
    stream = await client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


async def test_completions_stream_and_non_stream(stack):
    _, _, client = team_client(stack)
    resp = await client.completions.create(model=MODEL, prompt="one two three", max_tokens=2)
    assert resp.choices[0].text == "tok tok " and resp.usage.prompt_tokens == 3
    stream = await client.completions.create(model=MODEL, prompt="one two", max_tokens=3, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == "tok " * 3


async def test_model_name_mapping_and_models_list(stack):
    _, _, client = team_client(stack, TeamLimits(allowed_models=("other-model",)))
    resp = await client.chat.completions.create(model="other-model", messages=HELLO, max_tokens=1)
    assert resp.model == MODEL  # the upstream saw its own name
    models = await client.models.list()
    assert [m.id for m in models.data] == ["other-model"]
    with pytest.raises(openai.PermissionDeniedError) as exc:
        await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert exc.value.code == "model_not_allowed"


async def test_authentication_error(stack):
    client = openai.AsyncOpenAI(base_url=stack["url"] + "/v1", api_key="tw-" + "x" * 43, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        await client.chat.completions.create(model=MODEL, messages=HELLO)
    assert exc.value.code == "invalid_api_key"
    assert exc.value.response.headers.get("x-request-id")


async def test_rate_limit_error_carries_retry_after(stack):
    _, _, client = team_client(stack, TeamLimits(rpm=1))
    ok = await client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert ok.headers["x-ratelimit-limit-requests"] == "1" and ok.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError) as exc:
        await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert exc.value.code == "rate_limited"
    headers = exc.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "1" and headers["x-ratelimit-remaining-requests"] == "0"
    rid = headers["x-request-id"]
    (event,) = wait_events(stack, lambda e: e["request_id"] == rid)
    assert (event["status"], event["reason"], event["http_status"]) == ("rejected", "rate_limited", 429)
    assert event["prompt_tokens"] == 0 and event["completion_tokens"] == 0


async def test_too_long_prompt_is_bad_request(stack):
    _, _, client = team_client(stack, TeamLimits(max_prompt_tokens=50))
    long = [{"role": "user", "content": "word " * 500}]
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=long, max_tokens=1)
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "messages"
    rid = exc.value.response.headers["x-request-id"]
    (event,) = wait_events(stack, lambda e: e["request_id"] == rid)
    assert (event["status"], event["reason"], event["http_status"]) == ("rejected", "too_long", 400)
    with pytest.raises(openai.BadRequestError) as exc:  # prompt + context window: 4096 in this pool
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 40}] * 200)
    assert exc.value.code == "context_length_exceeded"


async def test_max_tokens_over_team_cap_and_missing_max_tokens_takes_the_cap(stack):
    team, _, client = team_client(stack, TeamLimits(max_output_tokens=7))
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8)
    assert exc.value.param == "max_tokens"
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, extra_body={"fake": {"tokens": 100}}
    )
    assert raw.parse().usage.completion_tokens == 7  # the upstream was told the team's cap
    (event,) = wait_events(stack, lambda e: e["request_id"] == raw.headers["x-request-id"])
    assert event["max_tokens"] == 7


async def test_unknown_model_is_not_found(stack):
    _, _, client = team_client(stack)
    with pytest.raises(openai.NotFoundError) as exc:
        await client.chat.completions.create(model="no-such-model", messages=HELLO)
    assert exc.value.code == "model_not_found"


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [("temperature", 3, "temperature"), ("top_p", 1.5, "top_p"), ("max_tokens", 0, "max_tokens"), ("n", 129, "n")],
)
async def test_invalid_fields_are_bad_requests(stack, field, value, param):
    _, _, client = team_client(stack)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=HELLO, extra_body={field: value})
    assert exc.value.param == param and exc.value.type == "invalid_request_error"


async def test_bad_bodies_get_openai_errors_never_500(stack):
    _, secret, _ = team_client(stack)
    auth = {"authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=stack["url"]) as http:
        r = await http.post("/v1/chat/completions", content=b"{nope", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await http.post("/v1/chat/completions", json={"model": MODEL}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "x"}]}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0")
        big = {"model": MODEL, "messages": [{"role": "user", "content": "a" * 70_000}]}
        r = await http.post("/v1/chat/completions", json=big, headers=auth)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        rid = r.headers["x-request-id"]
        (event,) = wait_events(stack, lambda e: e["request_id"] == rid)
        assert (event["status"], event["reason"], event["http_status"]) == ("rejected", "body_too_large", 413)
        r = await http.get("/v1/nothing-here", headers={"x-request-id": "my-id-1"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert r.headers["x-request-id"] == "my-id-1"


async def test_upstream_4xx_passes_through_and_metrics_count(stack):
    _, _, client = team_client(stack)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=HELLO, extra_body={"fake": {"status": 400}})
    assert exc.value.code == "injected"
    async with httpx.AsyncClient(base_url=stack["url"]) as http:
        text = (await http.get("/metrics")).text
    assert "tokenweir_gateway_requests_total" in text and 'status="ok"' in text
    assert "tokenweir_gateway_overhead_seconds_bucket" in text


async def test_stream_broken_after_first_byte_ends_with_an_sse_error_event(stack):
    team, secret, client = team_client(stack)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 10, "stream": True, "fake": {"fail_after": 2}}
    async with (
        httpx.AsyncClient(base_url=stack["url"]) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {secret}"}) as r,
    ):
        assert r.status_code == 200
        events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert len(events) == 4 and events[-1] == "data: [DONE]", events
    assert '"code":"upstream_broken"' in events[-2]
    with pytest.raises(openai.APIError):  # the SDK turns the error event into an exception
        stream = await client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=10, stream=True, extra_body={"fake": {"fail_after": 2}}
        )
        [c async for c in stream]
    (event,) = wait_events(stack, lambda e: e["team"] == team.id and e["request_id"] == r.headers["x-request-id"])
    assert (event["status"], event["reason"], event["completion_tokens"]) == ("error", "upstream_broken", 2)


async def test_metrics_show_per_team_budget_and_token_counters(stack):
    team, _, client = team_client(stack, TeamLimits(tokens_per_day=10_000))
    r = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    spent = r.usage.prompt_tokens + r.usage.completion_tokens
    async with httpx.AsyncClient(base_url=stack["url"]) as http:
        text = (await http.get("/metrics")).text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines[f'tokenweir_gateway_remaining_budget_tokens{{period="day",team="{team.id}"}}']) == 10_000 - spent
    assert float(lines[f'tokenweir_gateway_reserved_tokens{{team="{team.id}"}}']) == 0
    key = f'tokenweir_gateway_completion_tokens_total{{model="{MODEL}",team="{team.id}"}}'
    assert float(lines[key]) == 4


async def test_requests_refused_before_admission_still_end_as_one_event(stack):
    """A bad key, a malformed body and an admin key on the inference API each leave exactly one rejected event."""
    team, _, client = team_client(stack)
    stranger = openai.AsyncOpenAI(base_url=stack["url"] + "/v1", api_key="tw-not-a-real-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        await stranger.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    rid = exc.value.response.headers["x-request-id"]
    (event,) = wait_events(stack, lambda e: e["request_id"] == rid)
    assert (event["status"], event["http_status"], event["team"]) == ("rejected", 401, None)
    assert event["reason"] == exc.value.code and event["kind"] == "chat"  # its path says its kind
    with pytest.raises(openai.AuthenticationError) as exc:
        await stranger.embeddings.create(model=MODEL, input="hi")
    (event,) = wait_events(stack, lambda e: e["request_id"] == exc.value.response.headers["x-request-id"])
    assert (event["status"], event["http_status"], event["kind"]) == ("rejected", 401, "embeddings")

    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    rid = exc.value.response.headers["x-request-id"]
    (event,) = wait_events(stack, lambda e: e["request_id"] == rid)
    assert (event["status"], event["reason"], event["http_status"]) == ("rejected", "invalid_value", 400)
    assert event["team"] == team.id and event["model"] == MODEL and event["completion_tokens"] == 0

    admin_secret, _ = stack["store"].create_key(None, "admin-on-inference", is_admin=True)
    admin = openai.AsyncOpenAI(base_url=stack["url"] + "/v1", api_key=admin_secret, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as exc:
        await admin.completions.create(model="made-up-" + "x" * 40, prompt="hi", max_tokens=1)
    rid = exc.value.response.headers["x-request-id"]
    (event,) = wait_events(stack, lambda e: e["request_id"] == rid)
    assert (event["reason"], event["http_status"], event["kind"]) == ("no_team", 403, "completions")

    # client-chosen model names never become metric labels
    metrics = (await stranger._client.get(stack["url"] + "/metrics")).text
    assert "made-up-" not in metrics


async def test_two_teams_sending_one_x_request_id_get_separate_upstream_requests(stack):
    """The client's X-Request-Id is echoed and logged, but upstreams (and /abort) see an id of the gateway's own."""
    (team_a, _, a), (team_b, _, b) = team_client(stack), team_client(stack)
    same = {"x-request-id": "shared-by-two-clients"}
    ra, rb = await asyncio.gather(
        a.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=3, extra_headers=same),
        b.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=4, extra_headers=same),
    )
    assert ra.headers["x-request-id"] == rb.headers["x-request-id"] == "shared-by-two-clients"
    assert (ra.parse().usage.completion_tokens, rb.parse().usage.completion_tokens) == (3, 4)
    deadline = time.monotonic() + 5
    while len(events := wait_events(stack, lambda e: e["team"] in (team_a.id, team_b.id))) < 2:
        assert time.monotonic() < deadline, events
    assert {e["request_id"] for e in events} == {"shared-by-two-clients"}
    upstream_ids = {e["upstream_request_id"] for e in events}
    assert len(upstream_ids) == 2 and all(stack["fake"].records[u].completion_tokens in (3, 4) for u in upstream_ids)


async def test_inference_paths_answer_other_methods_and_are_documented(stack):
    """The inference POSTs take the app's own lane (gateway/server/lane.py); every other method on those paths, and
    the OpenAPI document, are still FastAPI's routes."""
    _, secret, _ = team_client(stack)
    async with httpx.AsyncClient(base_url=stack["url"]) as http:
        r = await http.get("/v1/chat/completions", headers={"authorization": f"Bearer {secret}"})
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        doc = (await http.get("/openapi.json")).json()
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            assert "post" in doc["paths"][path] and "requestBody" in doc["paths"][path]["post"]
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["x-request-id"]
