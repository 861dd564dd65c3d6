"""Two ways a pool answers where it used to fail, through real HTTP: client -> gateway -> fake upstream.

Retries with backoff (the fake answering 503 to its next N requests): a pool with `retries` goes through its plan
again after a backoff when every hop failed before its first byte: the client gets the answer, billed once, one
event whose route lists every try; without retries (or once they are spent) it is the 503 `upstream_unavailable` it
always was. Context-window fallbacks: a prompt too long for a pool's context goes to the first of its
`context_window_fallbacks` whose context fits it (the event names it); with none that fits, the 400
context_length_exceeded it always was."""

from __future__ import annotations

import time

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.events import the_event
from tests.support.metrics import gateway_metrics
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.stack import team
from tokenweir.gateway.config import BreakerConfig, EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store

PROMPT = [101, 102, 103, 104, 105, 106]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("retries")
    store = Store.open(f"sqlite:///{tmp}/store.db")
    fake = FakeUpstream(model="m")
    with ServerThread(fake) as upstream:
        pools = [
            PoolConfig(model="retrying", upstreams=[UpstreamConfig(upstream.url, model="m")], retries=3,
                       retry_backoff_s=0.1),
            PoolConfig(model="once", upstreams=[UpstreamConfig(upstream.url, model="m")]),
            PoolConfig(model="short", upstreams=[UpstreamConfig(upstream.url, model="m")], max_context=64,
                       context_window_fallbacks=["medium", "long"]),
            PoolConfig(model="medium", upstreams=[UpstreamConfig(upstream.url, model="m")], max_context=128),
            PoolConfig(model="long", upstreams=[UpstreamConfig(upstream.url, model="m")], max_context=4096),
        ]  # fmt: skip
        config = GatewayConfig(
            port=0,
            pools=pools,
            breaker=BreakerConfig(failures=10),  # the tries here must not open the circuit
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
        )
        with serve_app(config, store=store, state_backend=InMemoryState()) as gw:
            yield {"store": store, "url": gw.url, "events": tmp / "events.jsonl", "fake": fake}
    store.close()


def complete(stack, model: str, stream: bool) -> httpx.Response:
    _, secret = team(stack)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "stream": stream, "fake": {"tokens": 5}}
    return httpx.post(stack["url"] + "/v1/completions", json=body, headers={"authorization": f"Bearer {secret}"})


def retries(stack, model: str) -> float:
    return gateway_metrics(stack["url"]).get(("tokenweir_gateway_retries_total", (("model", model),)), 0.0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_pool_with_retries_answers_after_its_upstream_failed_twice(stack, stream):
    before = retries(stack, "retrying")
    stack["fake"].fail_next = 2
    started = time.monotonic()
    r = complete(stack, "retrying", stream)
    assert r.status_code == 200, r.text
    assert time.monotonic() - started >= 0.05 + 0.1  # two backoffs: 0.1 then 0.2 s, each at least half that
    event = the_event(stack["events"], r.headers["x-request-id"])
    assert (event["status"], event["completion_tokens"]) == ("ok", 5), event
    assert event["route"] == ["retrying@retrying-0"] * 3
    assert retries(stack, "retrying") == before + 2


def test_without_retries_or_once_they_are_spent_the_client_gets_a_503(stack):
    stack["fake"].fail_next = 1
    r = complete(stack, "once", stream=False)
    assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
    assert the_event(stack["events"], r.headers["x-request-id"])["route"] == ["once@once-0"]
    stack["fake"].fail_next = 4
    r = complete(stack, "retrying", stream=False)
    assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
    event = the_event(stack["events"], r.headers["x-request-id"])
    assert event["route"] == ["retrying@retrying-0"] * 4 and event["completion_tokens"] == 0
    stack["fake"].fail_next = 0


@pytest.mark.parametrize(("prompt_tokens", "served"), [(40, "short"), (100, "medium"), (1000, "long")])
def test_a_prompt_too_long_for_a_pools_context_goes_to_the_first_longer_one_that_fits(stack, prompt_tokens, served):
    _, secret = team(stack)
    body = {"model": "short", "prompt": [7] * prompt_tokens, "max_tokens": 5, "fake": {"tokens": 5}}
    r = httpx.post(stack["url"] + "/v1/completions", json=body, headers={"authorization": f"Bearer {secret}"})
    assert r.status_code == 200, r.text
    event = the_event(stack["events"], r.headers["x-request-id"])
    assert (event["status"], event["served_model"], event["prompt_tokens"]) == ("ok", served, prompt_tokens)
    assert event["route_reason"].get("context_window_fallback") == (None if served == "short" else served)


def test_a_prompt_no_pool_fits_is_refused_as_before(stack):
    _, secret = team(stack)
    for model, tokens in (("short", 5000), ("medium", 200)):  # past every fallback's context; a pool without any
        body = {"model": model, "prompt": [7] * tokens, "max_tokens": 5}
        r = httpx.post(stack["url"] + "/v1/completions", json=body, headers={"authorization": f"Bearer {secret}"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
