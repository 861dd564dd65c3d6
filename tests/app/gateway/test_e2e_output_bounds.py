"""What admission reserves is what the upstream can generate, on both state backends (InMemoryState, RedisState on
the real Redis), through real HTTP: client -> gateway -> fake upstream that reads the length fields as OpenAI and
vLLM do (chat: max_completion_tokens over max_tokens; completions: max_tokens only; a batch completes every prompt).

The fields that bound output (max_tokens, max_completion_tokens, n, best_of, the prompts of a batch) are typed on
both endpoints, so a bad value is a 400 naming it, never a 500 or a 503; a team's budget bounds what is served,
whatever the mix of fields; and output an upstream makes beyond the reservation is billed and named in the event.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.stack import events_of, team
from tests.support.state import URL, drop_redis_prefix, fresh_redis_prefix
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.state.redis import RedisState
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

MODEL = "m"
PROMPT = [101, 102, 103, 104, 105, 106]  # 6 token ids: the gateway's count and the upstream's agree exactly
CONTEXT = 2048


@pytest.fixture(scope="module", params=["memory", "redis"])
def stack(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"bounds-{request.param}")
    prefix = fresh_redis_prefix() if request.param == "redis" else None
    state = InMemoryState() if prefix is None else RedisState(URL, prefix=prefix)
    store = Store.open(f"sqlite:///{tmp}/store.db")
    fake = FakeUpstream(model=MODEL)
    with ServerThread(fake) as upstream:
        pool = PoolConfig(
            model=MODEL, upstreams=[UpstreamConfig(upstream.url)], max_context=CONTEXT, capacity=64, max_queued=4096
        )
        config = GatewayConfig(
            port=0,
            pools=[pool],
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
        )
        with serve_app(config, store=store, state_backend=state) as gw:
            yield {"store": store, "url": gw.url, "events": tmp / "events.jsonl", "fake": fake, "app": gw.app, "gw": gw}
    store.close()
    if prefix is not None:
        drop_redis_prefix(prefix)


def post(stack, secret: str, path: str, body: dict) -> httpx.Response:
    headers = {"authorization": f"Bearer {secret}"}
    return httpx.post(stack["url"] + path, json={"model": MODEL, **body}, headers=headers, timeout=30)


async def storm(stack, secret: str, path: str, body: dict, n: int) -> list[httpx.Response]:
    """`n` copies of one request, all in flight at once (each held 100 ms upstream, so that they overlap)."""
    body = {"model": MODEL, **body, "fake": {**body.get("fake", {}), "ttft_ms": 100}}
    headers = {"authorization": f"Bearer {secret}"}
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=stack["url"], headers=headers, timeout=30, limits=limits) as client:
        return await asyncio.gather(*(client.post(path, json=body) for _ in range(n)))


def served(stack, events: list[dict]) -> int:
    """Tokens the upstream itself counts for these requests: prompt and completion, as its own records say."""
    records = stack["fake"].records
    seen = [records[e["upstream_request_id"]] for e in events if e["upstream_request_id"] in records]
    return sum(r.prompt_tokens + r.completion_tokens for r in seen)


def refused(r: httpx.Response, param: str, code: str | None = None) -> None:
    assert r.status_code == 400, (param, r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"], err
    if code is not None:
        assert err["code"] == code, err


async def test_max_completion_tokens_on_completions_cannot_shrink_the_reservation_below_what_is_generated(stack):
    budget = 1000
    team_id, secret = team(stack, TeamLimits(tokens_per_day=budget))
    attack = {"prompt": PROMPT, "max_tokens": 200, "max_completion_tokens": 1, "fake": {"tokens": 200}}
    per_request = len(PROMPT) + 200
    attacked = await storm(stack, secret, "/v1/completions", attack, 20)
    assert served(stack, events_of(stack, team_id, 20)) <= budget + per_request
    for r in attacked:
        refused(r, "max_completion_tokens", "unsupported_parameter")
        assert "max_tokens" in r.json()["error"]["message"]
    # The same requests with the bound completions reads: the budget holds, overshoot at most one reservation.
    honest = {k: v for k, v in attack.items() if k != "max_completion_tokens"}
    results = await storm(stack, secret, "/v1/completions", honest, 20)
    assert {r.status_code for r in results} <= {200, 429}, [r.text for r in results if r.status_code not in (200, 429)]
    assert 0 < served(stack, events_of(stack, team_id, 40)) <= budget + per_request


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n", "best_of"])
@pytest.mark.parametrize(
    "value", ["5", -3, [1], {}, 2.5, True], ids=["string", "negative", "list", "object", "float", "bool"]
)
def test_a_badly_typed_output_bound_is_a_400_naming_the_field_on_either_endpoint(stack, path, field, value):
    _, secret = team(stack)
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    refused(post(stack, secret, path, {**body, "max_tokens": 4, field: value}), field)


def test_a_well_typed_max_completion_tokens_on_completions_is_refused_as_a_chat_parameter(stack):
    _, secret = team(stack)
    r = post(stack, secret, "/v1/completions", {"prompt": PROMPT, "max_completion_tokens": 4})
    refused(r, "max_completion_tokens", "unsupported_parameter")
    # null says nothing and passes, as an unset field does
    assert post(stack, secret, "/v1/completions", {"prompt": PROMPT, "max_completion_tokens": None}).status_code == 200


async def test_a_batch_of_prompts_is_reserved_per_prompt_and_stays_within_the_budget(stack):
    budget = 2000
    team_id, secret = team(stack, TeamLimits(tokens_per_day=budget))
    prompts = [[101 + i, 102 + i] for i in range(50)]  # 50 prompts of 2 token ids
    batch = {"prompt": prompts, "max_tokens": 20, "fake": {"tokens": 20}}
    results = await storm(stack, secret, "/v1/completions", batch, 10)
    assert {r.status_code for r in results} <= {200, 429}, [r.text for r in results if r.status_code not in (200, 429)]
    events = events_of(stack, team_id, 10)
    per_request = 100 + 50 * 20
    assert served(stack, events) <= budget + per_request
    ok = [r for r in results if r.status_code == 200]
    assert ok and all(len(r.json()["choices"]) == 50 for r in ok)
    assert all(e["max_tokens"] == 50 * 20 for e in events if e["status"] == "ok")


def test_a_batch_is_held_to_the_context_window_per_prompt_not_all_prompts_together(stack):
    _, secret = team(stack)
    prompts = [list(range(100 + i, 1100 + i)) for i in range(3)]  # 3 x 1000 tokens: each fits a 2048 context
    r = post(stack, secret, "/v1/completions", {"prompt": prompts, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 3000, "completion_tokens": 24, "total_tokens": 3024}
    too_long = post(stack, secret, "/v1/completions", {"prompt": [*prompts, list(range(CONTEXT))], "max_tokens": 8})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("n", [1, 3])
def test_on_chat_the_smaller_of_max_tokens_and_max_completion_tokens_bounds_and_is_sent(stack, n):
    team_id, secret = team(stack)
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": n, "fake": {"tokens": 50}}
    for fields in ({"max_tokens": 40, "max_completion_tokens": 5}, {"max_tokens": 5, "max_completion_tokens": 40}):
        marker = uuid.uuid4().hex
        r = post(stack, secret, "/v1/chat/completions", {**chat, **fields, "user": marker})
        assert r.status_code == 200, r.text
        sent = next(b for p, b in reversed(stack["fake"].received) if b.get("user") == marker)
        assert (sent["max_tokens"], sent["max_completion_tokens"]) == (5, 5), sent
        assert r.json()["usage"]["completion_tokens"] == 5 * n
    events = events_of(stack, team_id, 2)
    assert [e["max_tokens"] for e in events] == [5 * n, 5 * n]


@pytest.mark.parametrize("stream", [False, True])
def test_output_an_upstream_makes_beyond_the_reservation_is_billed_and_named_in_the_event(stack, stream):
    team_id, secret = team(stack)
    body = {"prompt": PROMPT, "max_tokens": 5, "stream": stream, "fake": {"tokens": 12, "overrun": True}}
    r = post(stack, secret, "/v1/completions", body)
    assert r.status_code == 200, r.text
    [event] = events_of(stack, team_id, 1)
    assert (event["max_tokens"], event["completion_tokens"], event["overrun_tokens"]) == (5, 12, 7), event
    snap = stack["gw"].call(stack["app"].state.services.state.snapshot(team_id))
    assert snap["spent_today"] == len(PROMPT) + 12, snap
