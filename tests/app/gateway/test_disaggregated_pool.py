"""A disaggregated pool through the gateway, on two tiny random Llamas in this process: a prefill member (engine with
kv_producer) and a decode member (kv_consumer). A chat or completion goes to the prefill member first (max_tokens 1),
then to the decode member with the answer's kv_transfer_params; the client gets one engine's tokens, streamed or not,
billed once (the decode hop's usage: the prefill hop's token is the route's, not the client's), and one event naming
both members. A prefill member that cannot be reached leaves the prompt to the decode member: same tokens, the event
says no prefill member served it and why. One that hangs uses up the request's TTFT budget, which covers both hops:
a 504 with one event, nothing billed that the decode member did not make, and its blocks all back. With its decode
member down, the prefill member answers the whole request and lets the prompt's KV go at once."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.app.engine.test_server import greedy_reference
from tests.support.events import the_event
from tests.support.kv_transfer import KV_KEY
from tests.support.metrics import gateway_metrics
from tests.support.raw_upstream import silent_port
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.tiny_llama import make_tiny_llama
from tokenweir.engine.api import build_app
from tokenweir.engine.config import EngineConfig, KVTransferConfig
from tokenweir.engine.core.async_engine import AsyncEngine
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig, config_digest
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

PROMPT = [(11 * i + 5) % 250 + 2 for i in range(50)]


def engine(model: str, role: str) -> LLMEngine:
    config = EngineConfig(
        model=model, served_model_name="tiny", num_kv_blocks=64, quantization="none", num_threads=1, dtype="float32",
        kv_transfer=KVTransferConfig(kv_role=role, transfer_key=KV_KEY),
    )  # fmt: skip
    return LLMEngine(config)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hung_port():
    with silent_port() as port:
        yield port


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hung_port):
    tmp = tmp_path_factory.mktemp("disagg-pool")
    model = make_tiny_llama(str(tmp / "tiny"), seed=5, max_position_embeddings=512)
    producer, consumer = engine(model, "kv_producer"), engine(model, "kv_consumer")
    store = Store.open(f"sqlite:///{tmp}/store.db")
    team = store.create_team("t", TeamLimits())
    secret, _ = store.create_key(team.id, "k")
    events = tmp / "events.jsonl"
    with ServerThread(build_app(AsyncEngine(producer))) as pre, ServerThread(build_app(AsyncEngine(consumer))) as dec:
        pools = [
            PoolConfig(
                model="tiny",
                upstreams=[
                    UpstreamConfig(pre.url, name="prefill", role="prefill"),
                    UpstreamConfig(dec.url, name="decode", role="decode"),
                ],
            ),
            PoolConfig(
                model="tiny-gone",
                upstreams=[
                    UpstreamConfig(f"http://127.0.0.1:{closed_port()}", name="prefill", role="prefill", model="tiny"),
                    UpstreamConfig(dec.url, name="decode", role="decode", model="tiny"),
                ],
            ),
            PoolConfig(
                model="tiny-no-decode",
                upstreams=[
                    UpstreamConfig(pre.url, name="prefill", role="prefill", model="tiny"),
                    UpstreamConfig(f"http://127.0.0.1:{closed_port()}", name="decode", role="decode", model="tiny"),
                ],
            ),
            PoolConfig(
                model="tiny-hung",
                ttft_timeout_s=1.0,
                upstreams=[
                    UpstreamConfig(f"http://127.0.0.1:{hung_port}", name="prefill", role="prefill", model="tiny"),
                    UpstreamConfig(dec.url, name="decode", role="decode", model="tiny"),
                ],
            ),
        ]
        config = GatewayConfig(port=0, pools=pools, events=EventsConfig(path=str(events), flush_interval_s=0.05))
        with serve_app(config, store=store) as gw:
            yield {
                "url": gw.url,
                "events": events,
                "auth": {"authorization": f"Bearer {secret}"},
                "model": model,
                "producer": producer,
                "consumer": consumer,
                "config": config,
            }
    store.close()


def complete(stack, model: str, stream: bool) -> tuple[list[int], dict, str]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(stack["url"] + "/v1/completions", json=body, headers=stack["auth"], timeout=60)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["token_ids"], r.json()["usage"], r.headers["x-request-id"]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    tokens = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    return tokens, events[-1]["usage"], r.headers["x-request-id"]


@pytest.mark.parametrize("stream", [False, True])
def test_two_hops_give_one_engines_tokens_billed_once_with_one_event(stack, stream):
    expected = greedy_reference(stack["model"], PROMPT, 20)
    fetched = stack["consumer"].kv_transfer.num_fetches
    tokens, usage, request_id = complete(stack, "tiny", stream)
    assert tokens == expected
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), 20)
    event = the_event(stack["events"], request_id)
    assert (event["instance"], event["prefill_instance"]) == ("tiny@decode", "tiny@prefill")
    assert (event["prompt_tokens"], event["completion_tokens"], event["status"]) == (len(PROMPT), 20, "ok")
    assert 0 < event["prefill_ms"] <= event["ttft_ms"]
    # the decode member fetched what its own prefix cache did not hold (all but the last prompt token: computed there)
    assert event["kv_fetched_tokens"] + event["cached_tokens"] == len(PROMPT) - 1
    assert event["kv_fetched_bytes"] > 0 and event["kv_fetch_ms"] > 0
    assert (
        stack["consumer"].kv_transfer.num_fetches == fetched + 1
        and stack["consumer"].kv_transfer.num_fetch_failures == 0
    )
    deadline = time.monotonic() + 5
    while len(stack["producer"].kv_transfer.pins) and time.monotonic() < deadline:  # freed once the fetch is confirmed
        time.sleep(0.02)
    assert len(stack["producer"].kv_transfer.pins) == 0


def test_a_prefill_member_out_of_reach_leaves_the_prompt_to_the_decode_member(stack):
    expected = greedy_reference(stack["model"], PROMPT, 20)
    fetched = stack["consumer"].kv_transfer.num_fetches
    tokens, usage, request_id = complete(stack, "tiny-gone", stream=True)
    assert tokens == expected and usage["completion_tokens"] == 20
    event = the_event(stack["events"], request_id)
    assert event["status"] == "ok" and event["instance"] == "tiny-gone@decode"
    assert event["prefill_instance"] is None and "prefill tiny-gone@prefill" in event["upstream_error"]
    assert event["kv_fetched_bytes"] is None
    assert stack["consumer"].kv_transfer.num_fetches == fetched  # nothing to fetch: it computed the prompt


def test_a_hung_prefill_member_spends_a_streams_ttft_budget_which_covers_both_hops(stack):
    body = {"model": "tiny-hung", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stream": True}
    started = time.monotonic()
    r = httpx.post(stack["url"] + "/v1/completions", json=body, headers=stack["auth"], timeout=60)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    assert 1.0 <= time.monotonic() - started < 5.0
    event = the_event(stack["events"], r.headers["x-request-id"])
    assert (event["status"], event["reason"], event["prefill_instance"]) == ("timeout", "ttft_timeout", None), event
    assert "prefill tiny-hung@prefill" in event["upstream_error"] and event["completion_tokens"] == 0
    blocks = stack["consumer"].block_manager
    deadline = time.monotonic() + 5
    while blocks.num_free_blocks < blocks.num_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert blocks.num_free_blocks == blocks.num_blocks


def test_a_hung_prefill_member_leaves_a_whole_response_to_the_decode_member_after_the_ttft_limit(stack):
    expected = greedy_reference(stack["model"], PROMPT, 20)
    started = time.monotonic()
    tokens, usage, request_id = complete(stack, "tiny-hung", stream=False)
    assert tokens == expected and usage["completion_tokens"] == 20
    assert time.monotonic() - started >= 1.0  # the prefill hop was given the TTFT limit, no more
    event = the_event(stack["events"], request_id)
    assert (event["status"], event["instance"], event["prefill_instance"]) == ("ok", "tiny-hung@decode", None)
    assert "prefill tiny-hung@prefill" in event["upstream_error"]


def test_with_no_decode_member_the_prefill_member_answers_and_lets_its_pin_go(stack):
    expected = greedy_reference(stack["model"], PROMPT, 20)
    tokens, usage, request_id = complete(stack, "tiny-no-decode", stream=True)
    assert tokens == expected and (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), 20)
    event = the_event(stack["events"], request_id)
    assert (event["status"], event["completion_tokens"]) == ("ok", 20)
    assert (event["instance"], event["prefill_instance"]) == ("tiny-no-decode@prefill", "tiny-no-decode@prefill")
    assert event["route"] == ["tiny-no-decode@decode", "tiny-no-decode@prefill"] and event["kv_fetched_bytes"] is None
    pins = stack["producer"].kv_transfer.pins
    deadline = time.monotonic() + 3  # released by the gateway's abort, not the pin's 30 s timeout
    while len(pins) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(pins) == 0


def test_events_and_metrics_name_the_model_revision_and_the_configuration(stack):
    revision = stack["consumer"].model_revision  # the engine's model-file digest, from its /load
    info = ("tokenweir_gateway_model_info", (("model", "tiny"), ("revision", revision), ("upstream", "decode")))
    deadline = time.monotonic() + 10
    while gateway_metrics(stack["url"]).get(info) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gateway_metrics(stack["url"]).get(info) == 1
    _, _, request_id = complete(stack, "tiny", stream=False)
    assert the_event(stack["events"], request_id)["model_revision"] == revision
    metrics = gateway_metrics(stack["url"])
    configs = [labels for (name, labels), value in metrics.items() if name == "tokenweir_gateway_config_info"]
    assert configs == [(("digest", config_digest(stack["config"])),)]
    assert metrics[("tokenweir_gateway_config_loaded_timestamp_seconds", ())] <= time.time()
