"""Prefix routing wired into the pool: route plans follow the index, /load's evictions are forgotten, and the
decision lands on the request and in metrics. No HTTP: /load answers are set as the poller would set them."""

from collections import Counter
from types import SimpleNamespace

import pytest

from tests.support.context_stand_in import ContextStandIn
from tokenweir.common.text.prefix_hash import block_hashes, probe
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.config import GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.request.cache_scope import cache_salt
from tokenweir.gateway.request.dispatch import Dispatcher
from tokenweir.gateway.upstream.load_poll import forget_evicted
from tokenweir.gateway.upstream.pools import Upstreams

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
    # routing uses no client, member slots, background tasks, token counts or settler
    dispatcher = Dispatcher(GatewayConfig(), upstreams, None, metrics, None, None, None, None)
    # a prompt of token ids needs no tokenizer; a text prompt in a pool that names none goes by load
    ctx = ContextStandIn(
        model="m",
        kind="completions",
        body={"prompt": TEAM},
        route_reason=None,
        context_fallback=None,
        prompt_ids=None,  # admission counted no chat
        alias=None,  # no alias's variant (a canary's plan ends with its baseline)
        routes=upstreams.routes,
        pools=upstreams.pools,
        team_id="t",
        key_id="k",
    )
    hops, hashes = dispatcher.route(ctx)
    assert ctx.route_reason["reason"] == "prefix_home" and ctx.route_reason["instance"] == hops[0].instance.name
    assert hashes == block_hashes(TEAM, 16, salt=cache_salt("team", "t", "k"))  # the pool's cache scope: the team's
    text_ctx = ContextStandIn(
        model="m",
        kind="completions",
        body={"prompt": "hello"},
        route_reason=None,
        context_fallback=None,
        prompt_ids=None,  # admission counted no chat
        alias=None,  # no alias's variant (a canary's plan ends with its baseline)
        routes=upstreams.routes,
        pools=upstreams.pools,
        team_id="t",
        key_id="k",
    )
    dispatcher.route(text_ctx)
    assert text_ctx.route_reason["reason"] == "least_loaded"
    text = metrics.render().decode()
    assert 'tokenweir_gateway_routing_decisions_total{pool="m",reason="prefix_home"} 1.0' in text
    assert 'tokenweir_gateway_routing_decisions_total{pool="m",reason="least_loaded"} 1.0' in text
    assert 'tokenweir_gateway_routing_prefix_hit_blocks_count{pool="m"} 1.0' in text


def test_a_plain_chats_count_gives_the_engines_ids_and_routing_uses_them_without_tokenizing_again():
    """The prompt is tokenized once: admission's exact count of a chat of string messages makes the very ids the
    engine computes (its own request model renders the reference), text parts joined as the engine joins them, and
    routing hashes those; tools, earlier calls and names are rendered as the engine renders them (the engine's own
    encode_chat is the reference)."""
    pytest.importorskip("gguf")
    from tokenweir.engine.api.protocol import ChatCompletionRequest
    from tokenweir.engine.api.routes import encode_chat
    from tokenweir.engine.tool_parsers import tool_parser
    from tokenweir.gateway.openai.prompt_ids import _tokenizer
    from tokenweir.gateway.openai.token_count import ChatShape, TokenCounter

    tok = _tokenizer("default")
    counter = TokenCounter("default")
    plain = [
        {"role": "system", "content": "You are terse. " * 20},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "again"},
    ]
    parts = [*plain, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    for chat in (plain, parts):  # text parts are joined as the engine joins them: the same ids
        count, ids = counter.chat_prompt(chat)
        engine = ChatCompletionRequest(model="m", messages=chat).template_messages()
        assert ids == tok.encode_chat(engine, True) and count == len(ids)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for body in (  # tools, earlier calls and their results, names: rendered as the engine renders them
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]},
        {"messages": [{"role": "user", "content": "hi", "name": "ann"}], "add_generation_prompt": False},
        {"messages": [*plain, {"role": "tool", "tool_call_id": "c1", "content": "3"}], "tools": tools},
        {"messages": plain, "tools": tools, "tool_choice": "none"},
    ):
        request = ChatCompletionRequest(model="m", **body)
        engine = encode_chat(
            SimpleNamespace(tokenizer=tok),
            request.template_messages(),
            request.add_generation_prompt,
            request.tool_dicts(),
            tool_parser("hermes"),
        )
        assert counter.chat_prompt(body["messages"], None, ChatShape.of(body, "hermes")) == (len(engine), engine)
    count, ids = counter.chat_prompt(plain)

    upstreams = _upstreams()
    upstreams.pools["m"].cfg.tokenizer = "default"
    dispatcher = Dispatcher(GatewayConfig(), upstreams, None, Metrics(), None, None, None, None)
    encoded: list[object] = []
    real = tok.encode_chat
    tok.encode_chat = lambda messages, *a: encoded.append(messages) or real(messages, *a)  # counts, then encodes
    try:
        ctx = ContextStandIn(
            model="m", kind="chat", body={"model": "m", "messages": plain}, route_reason=None, context_fallback=None,
            prompt_ids=("default", ids), alias=None, routes=upstreams.routes, pools=upstreams.pools, team_id="t",
            key_id="k",
        )  # fmt: skip
        _, hashes = dispatcher.route(ctx)
    finally:
        del tok.encode_chat
    assert [len(m) for m in encoded] == [1]  # only the system part alone (the head), never the whole prompt again
    ctx.prompt_ids, ctx.route_reason = None, None  # as for a chat whose count made no ids: routing tokenizes it
    assert dispatcher.route(ctx)[1] == hashes


def test_a_completions_count_gives_the_engines_ids_and_routing_uses_them_without_tokenizing_again():
    """A /v1/completions prompt of one string is tokenized once too: the count's ids are what prefix routing would
    have made (and what the engine computes); a batch, or token ids, gives none (routing reads token ids as they
    are)."""
    pytest.importorskip("gguf")
    from tokenweir.gateway.openai.prompt_ids import _tokenizer, prompt_token_ids
    from tokenweir.gateway.openai.token_count import TokenCounter

    tok, counter = _tokenizer("default"), TokenCounter("default")
    text = "Once upon a time, " * 30
    counts, ids = counter.completion_prompts(text)
    assert ids == prompt_token_ids("default", "completions", {"prompt": text}) and counts == counter.count_prompts(text)
    assert counter.completion_prompts([text]) == (counts, ids)
    assert counter.completion_prompts([text, "b"])[1] is None and counter.completion_prompts([1, 2, 3])[1] is None
    assert TokenCounter(None).completion_prompts(text)[1] is None  # an estimate names no ids

    upstreams = _upstreams()
    upstreams.pools["m"].cfg.tokenizer = "default"
    dispatcher = Dispatcher(GatewayConfig(), upstreams, None, Metrics(), None, None, None, None)
    encoded: list[str] = []
    real = tok.encode
    tok.encode = lambda s, **kw: encoded.append(s) or real(s, **kw)
    try:
        ctx = ContextStandIn(
            model="m", kind="completions", body={"model": "m", "prompt": text}, route_reason=None,
            context_fallback=None, prompt_ids=("default", ids), alias=None, routes=upstreams.routes,
            pools=upstreams.pools, team_id="t", key_id="k",
        )  # fmt: skip
        _, hashes = dispatcher.route(ctx)
    finally:
        del tok.encode
    assert encoded == []  # routing hashed the count's ids
    ctx.prompt_ids, ctx.route_reason = None, None
    assert dispatcher.route(ctx)[1] == hashes  # the same hashes as tokenizing again


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


TOPICS = ["billing", "search ranking", "mobile apps", "fraud checks", "the data lake", "payments", "ads", "maps"]


def _preamble_chat(team: int, question: int) -> dict:
    """A team's chat: its system part opens with the preamble every team shares (the template's header and "You are
    an assistant for a team that works on"), then its own words; a short user question."""
    system = (
        "You are an assistant at Example Corp, a company that builds software for shops, for a team that works on "
        f"{TOPICS[team]}. Answer briefly and cite the runbook."
    )
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {question}?"}]}


def _two_engines() -> Upstreams:
    ups = [UpstreamConfig(f"http://e{i}:1", name=f"e{i}") for i in range(2)]
    upstreams = Upstreams(GatewayConfig(pools=[PoolConfig(model="m", upstreams=ups, tokenizer="default")]))
    for inst in upstreams.pools["m"].instances:
        inst.load = _load()
        forget_evicted(inst, inst.load)
    return upstreams


@pytest.mark.parametrize("concurrent", [False, True])
def test_teams_sharing_only_a_preamble_spread_and_each_keeps_to_its_home(concurrent):
    """The default tokenizer's real ids: 8 teams whose system parts share their first 30 tokens (the first block
    whole). Homed by the first block, every team's first request found the preamble cached on the engine that served
    the first team, and went there: all on one engine."""
    from tokenweir.gateway.openai.prompt_ids import head_tokens, prompt_token_ids

    upstreams = _two_engines()
    placed: dict[int, list[str]] = {t: [] for t in range(len(TOPICS))}
    held = []
    for i in range(12 * len(TOPICS)):
        team = i % len(TOPICS)
        body = _preamble_chat(team, i)
        ids = prompt_token_ids("default", "chat", body)
        assert ids is not None
        head = head_tokens("default", body, ids)
        assert 32 < head < len(ids)  # the system part, rendered alone, is the prompt's own beginning
        hops, why, hashes = upstreams.route("m", ids, head=head)
        upstreams.record(hops[0], hashes)
        placed[team].append(hops[0].instance.name)
        if concurrent:  # 4 in flight at a time (under the load bound: a team stays home)
            hops[0].instance.take(0.0)
            held.append(hops[0].instance)
            if len(held) == 4:
                for inst in held:
                    inst.done(True, 0.0)
                held.clear()
    engines = Counter(name for names in placed.values() for name in names)
    assert set(engines) == {"e0", "e1"}, engines  # both engines used
    for team, names in placed.items():
        assert Counter(names).most_common(1)[0][1] >= 0.8 * len(names), (team, names)
