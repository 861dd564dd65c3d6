"""A request served by a speculating engine (the tiny random Llama, prompt lookup on a repeated prompt) through the
gateway: its event names the drafts the engine checked and the share it kept, from the usage's
completion_tokens_details, streamed or not; a request that drafted nothing leaves both null."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.events import the_event
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.tiny_llama import make_tiny_llama
from tokenweir.engine.api import build_app
from tokenweir.engine.config import EngineConfig, SpeculativeConfig
from tokenweir.engine.core.async_engine import AsyncEngine
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

PROMPT = [5, 17, 42, 5, 17, 42, 5, 17]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("event-drafts")
    model = make_tiny_llama(str(tmp / "tiny"), seed=4, max_position_embeddings=512)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, cost_aware=False)
    engine = LLMEngine(
        EngineConfig(model=model, served_model_name="tiny", num_kv_blocks=64, quantization="none", speculative=spec)
    )
    store = Store.open(f"sqlite:///{tmp}/store.db")
    team = store.create_team("t", TeamLimits())
    secret, _ = store.create_key(team.id, "k")
    events = tmp / "events.jsonl"
    with ServerThread(build_app(AsyncEngine(engine))) as eng:
        config = GatewayConfig(
            port=0,
            pools=[PoolConfig(model="tiny", upstreams=[UpstreamConfig(eng.url, name="e")])],
            events=EventsConfig(path=str(events), flush_interval_s=0.05),
        )
        with serve_app(config, store=store) as gw:
            yield {"url": gw.url, "events": events, "auth": {"authorization": f"Bearer {secret}"}}
    store.close()


@pytest.mark.parametrize("stream", [False, True])
def test_the_event_carries_the_drafts_and_their_acceptance(stack, stream):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(stack["url"] + "/v1/completions", json=body, headers=stack["auth"], timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        usage = [line for line in r.text.splitlines() if '"usage":{' in line][-1]
        details = json.loads(usage.removeprefix("data: "))["usage"]["completion_tokens_details"]
    else:
        details = r.json()["usage"]["completion_tokens_details"]
    accepted, rejected = details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]
    assert accepted > 0 and rejected > 0
    event = the_event(stack["events"], r.headers["x-request-id"])
    assert event["draft_tokens"] == accepted + rejected
    assert event["draft_acceptance"] == round(accepted / (accepted + rejected), 4)
    assert event["completion_tokens"] == 40


def test_a_request_without_drafts_leaves_the_fields_null(stack):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "speculative": False}
    r = httpx.post(stack["url"] + "/v1/completions", json=body, headers=stack["auth"], timeout=60)
    assert r.status_code == 200, r.text
    event = the_event(stack["events"], r.headers["x-request-id"])
    assert event["draft_tokens"] is None and event["draft_acceptance"] is None
