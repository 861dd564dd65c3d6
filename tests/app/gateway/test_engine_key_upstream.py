"""A pool member's `api_key` goes on every call the gateway makes to it: requests, the /load and /v1/models polls and
/abort, against a real engine (the tiny random Llama) that refuses calls without it. A member whose key the engine
refuses is a failed instance (a 503 to the tenant naming no address), not the tenant's 401."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.serve_thread import ServerThread, serve_app
from tests.support.tiny_llama import make_tiny_llama
from tokenweir.engine.api import build_app
from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.async_engine import AsyncEngine
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store
from tokenweir.gateway.upstream import calls
from tokenweir.gateway.upstream.pools import Hop
from tokenweir.policies.limits import TeamLimits

KEY = "engine-key-for-the-gateway"
PROMPT = [5, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-key")
    model = make_tiny_llama(str(tmp / "tiny"), seed=1)
    engine = LLMEngine(
        EngineConfig(model=model, served_model_name="tiny", num_kv_blocks=64, num_threads=1, quantization="none")
    )
    store = Store.open(f"sqlite:///{tmp}/store.db")
    team = store.create_team("t", TeamLimits())
    secret, _ = store.create_key(team.id, "k")
    with ServerThread(build_app(AsyncEngine(engine), api_key=KEY)) as eng:
        config = GatewayConfig(
            port=0,
            pools=[
                PoolConfig(model="tiny", upstreams=[UpstreamConfig(eng.url, name="e", api_key=KEY)]),
                PoolConfig(model="wrong", upstreams=[UpstreamConfig(eng.url, name="e", api_key="nope", model="tiny")]),
            ],
            load_poll_interval_s=0.1,
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
        )
        with serve_app(config, store=store) as gw:
            yield {"url": gw.url, "engine": eng.url, "app": gw.app, "auth": {"authorization": f"Bearer {secret}"}}
    store.close()


def instance(stack, pool: str):
    return stack["app"].state.services.upstreams.get(pool).instances[0]


def test_the_engine_refuses_a_keyless_caller(stack):
    assert httpx.get(stack["engine"] + "/load").status_code == 401
    assert httpx.get(stack["engine"] + "/health").status_code == 200


def test_load_and_models_polls_send_the_key(stack):
    deadline = time.monotonic() + 10
    keyed = instance(stack, "tiny")
    while keyed.load is None or keyed.max_model_len is None:
        assert time.monotonic() < deadline, "the /load or /v1/models poll never got an answer"
        time.sleep(0.05)
    assert keyed.load["num_total_blocks"] == 64 and keyed.max_model_len > 0
    assert instance(stack, "wrong").load is None, "the engine refuses the wrong key's polls"


def test_requests_go_through_with_the_key(stack):
    for stream in (False, True):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream": stream}
        r = httpx.post(stack["url"] + "/v1/completions", json=body, headers=stack["auth"], timeout=30)
        assert r.status_code == 200, r.text


def test_a_refused_key_is_an_instance_failure_that_names_no_address(stack):
    body = {"model": "wrong", "prompt": PROMPT, "max_tokens": 3}
    r = httpx.post(stack["url"] + "/v1/completions", json=body, headers=stack["auth"], timeout=30)
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "wrong@e" in message and "refused the gateway's API key" in message
    assert "127.0.0.1" not in r.text and "http://" not in r.text


async def test_abort_sends_the_key(stack):
    client = calls.make_client()
    try:
        answer = await calls.abort(client, Hop("tiny", instance(stack, "tiny")), "no-such-request")
        assert answer == {"request_id": "no-such-request", "status": "unknown", "usage": None}
        assert await calls.abort(client, Hop("wrong", instance(stack, "wrong")), "no-such-request") is None
    finally:
        await client.aclose()
