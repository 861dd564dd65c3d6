"""Prefix routing wired into the pool: route plans follow the index, /load's evictions are forgotten, and the
decision lands on the request and in metrics. No HTTP: /load answers are set as the poller would set them."""

from types import SimpleNamespace

import pytest

from tokenweir.common.text.prefix_hash import block_hashes, probe
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.config import GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.request.dispatch import Dispatcher
from tokenweir.gateway.upstream.pools import Upstreams, forget_evicted

TEAM = list(range(200)) + [7, 8, 9]


def _load(**kw) -> dict:
    return {
        "num_running": 0,
        "num_waiting": 0,
        "kv_cache_usage": 0.0,
        "block_size": 16,
        "prefix_caching": True,
        "prefix_hash_probe": probe(16),
        "evicted_epoch": "e1",
        "evicted_seq": 0,
        "evicted_hashes": [],
        "evicted_complete": True,
    } | kw


def _upstreams(route: str | None = None, engine: bool = True) -> Upstreams:
    ups = [UpstreamConfig(f"http://e{i}:1", name=f"e{i}", engine=engine) for i in range(3)]
    ups.append(UpstreamConfig("http://ext:1", name="ext", engine=False))
    config = GatewayConfig(pools=[PoolConfig(model="m", upstreams=ups[:3] if engine else ups, route=route)])
    upstreams = Upstreams(config)
    for inst in upstreams.pools["m"].instances:
        if inst.cfg.engine:
            inst.load = _load()
            forget_evicted(inst, inst.load)
    return upstreams


def _first(upstreams: Upstreams, ids):
    hops, why, hashes = upstreams.route("m", ids)
    upstreams.record(hops[0], hashes)
    return hops[0].instance, why


def test_a_prefix_sticks_and_an_eviction_reported_on_load_is_forgotten():
    upstreams = _upstreams()
    assert upstreams.pools["m"].cfg.strategy == "prefix"
    home, why = _first(upstreams, TEAM)
    assert why.reason == "prefix_home"
    home.in_flight = 1
    again, why = _first(upstreams, TEAM[:-1] + [10])
    assert again is home and why.reason == "prefix_hit" and why.hit_blocks == 12
    # the engine evicted the prefix: the next poll forgets it
    home.load = _load(evicted_seq=12, evicted_hashes=block_hashes(TEAM, 16))
    forget_evicted(home, home.load)
    assert home.evicted_seq == 12
    _, why = _first(upstreams, TEAM)
    assert why.hit_blocks == 0
    # an engine restart (another eviction log) forgets everything it was said to hold
    _first(upstreams, TEAM)
    assert upstreams.pools["m"].index.match(block_hashes(TEAM, 16))
    for inst in upstreams.pools["m"].instances:
        inst.load = _load(evicted_epoch="e2")
        forget_evicted(inst, inst.load)
    assert upstreams.pools["m"].index.match(block_hashes(TEAM, 16)) == {}


def test_no_token_ids_or_unknown_hash_means_least_loaded():
    upstreams = _upstreams()
    for i, inst in enumerate(upstreams.pools["m"].instances):
        inst.in_flight = 2 - i
    hops, why, hashes = upstreams.route("m", None)
    assert why.reason == "least_loaded" and hops[0].instance.name == "e2" and hashes == []
    for inst in upstreams.pools["m"].instances:
        inst.load = _load(prefix_hash_probe=12345)  # another hash function: no prefix routing
    hops, why, hashes = upstreams.route("m", TEAM)
    assert why.reason == "least_loaded" and hashes == []


def test_external_pools_default_to_least_in_flight_and_round_robin_turns():
    upstreams = _upstreams(engine=False)
    assert upstreams.pools["m"].cfg.strategy == "least_loaded"
    upstreams = _upstreams(route="round_robin")
    firsts = [upstreams.route("m", TEAM)[0][0].instance.name for _ in range(4)]
    assert firsts == ["e0", "e1", "e2", "e0"]


def test_dispatcher_puts_the_decision_on_the_request_and_in_metrics():
    upstreams, metrics = _upstreams(), Metrics()
    dispatcher = Dispatcher(GatewayConfig(), upstreams, None, metrics, None)
    # a prompt of token ids needs no tokenizer; a text prompt in a pool that names none goes by load
    ctx = SimpleNamespace(
        model="m",
        kind="completions",
        body={"prompt": TEAM},
        route_reason=None,
        context_fallback=None,
        routes=upstreams.routes,
        pools=upstreams.pools,
    )
    hops, hashes = dispatcher.route(ctx)
    assert ctx.route_reason["reason"] == "prefix_home" and ctx.route_reason["instance"] == hops[0].instance.name
    assert hashes == block_hashes(TEAM, 16)
    text_ctx = SimpleNamespace(
        model="m",
        kind="completions",
        body={"prompt": "hello"},
        route_reason=None,
        context_fallback=None,
        routes=upstreams.routes,
        pools=upstreams.pools,
    )
    dispatcher.route(text_ctx)
    assert text_ctx.route_reason["reason"] == "least_loaded"
    text = metrics.render().decode()
    assert 'tokenweir_gateway_routing_decisions_total{pool="m",reason="prefix_home"} 1.0' in text
    assert 'tokenweir_gateway_routing_decisions_total{pool="m",reason="least_loaded"} 1.0' in text
    assert 'tokenweir_gateway_routing_prefix_hit_blocks_count{pool="m"} 1.0' in text


def test_prompt_ids_match_the_engines_own_encoding():
    """The gateway tokenizes a chat as the engine will (engine/api/protocol.py to_template + encode_chat), so its block
    hashes name the engine's cache keys."""
    pytest.importorskip("gguf")
    from tokenweir.engine.api.protocol import ChatCompletionRequest
    from tokenweir.gateway.openai.prompt_ids import _tokenizer, prompt_token_ids

    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are terse. " * 20},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
    }
    tok = _tokenizer("default")
    engine_ids = tok.encode_chat(ChatCompletionRequest(**body).template_messages(), True)
    assert prompt_token_ids("default", "chat", body) == engine_ids
    ids = prompt_token_ids("default", "completions", {"prompt": "hello world"})
    assert ids[-2:] == tok.encode("hello world")[-2:]
