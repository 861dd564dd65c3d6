"""The cache scope the gateway sets on every upstream request (gateway/request/cache_scope.py): a salt per team (or
key, or none for a shared pool), a client's own salt mixed in and never in charge, the same salt in the body sent and
in the block hashes the router looks up, which are the engine's own."""

import pytest
from pydantic import ValidationError

from tests.support.context_stand_in import ContextStandIn
from tests.unit.gateway.test_prefix_routing import _load, _upstreams
from tokenweir.common.text.prefix_hash import block_hashes
from tokenweir.engine.sched.block_manager import BlockManager
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.config import GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.openai.schema import CHAT, COMPLETION
from tokenweir.gateway.request.cache_scope import cache_salt, with_salt
from tokenweir.gateway.request.dispatch import Dispatcher
from tokenweir.gateway.runtime.routing_sync import pool_body, pool_from_body
from tokenweir.gateway.upstream.load_poll import forget_evicted
from tokenweir.gateway.upstream.pools import Upstreams

PROMPT = list(range(200)) + [7, 8, 9]


def test_a_team_scope_is_one_salt_for_every_key_of_the_team_and_another_for_each_team():
    assert cache_salt("team", "A", "a1") == cache_salt("team", "A", "a2")
    assert cache_salt("team", "A", "a1") != cache_salt("team", "B", "a1")


def test_a_key_scope_is_one_salt_per_key_and_a_shared_scope_is_none():
    assert cache_salt("key", "A", "a1") != cache_salt("key", "A", "a2")
    assert cache_salt("key", "A", "a1") != cache_salt("team", "A", "a1")
    assert cache_salt("shared", "A", "a1") is None is cache_salt("shared", "B", "b1")


def test_a_client_salt_narrows_its_scope_and_never_reaches_another_teams_salt():
    team_a = cache_salt("team", "A", "a1")
    assert team_a is not None
    assert cache_salt("team", "A", "a1", "mine") not in (team_a, None)
    # team B sending team A's salt, or A's id, as its own salt gets a salt of its own
    for guess in (team_a, "A", "a1", ""):
        assert cache_salt("team", "B", "b1", guess) != team_a
    # a shared pool passes no client salt through as it is: none can name a team's salt
    assert cache_salt("shared", "B", "b1", team_a) != team_a


def test_the_body_sent_carries_the_gateways_salt_in_place_of_the_clients():
    body = {"model": "m", "cache_salt": "mine", "prompt": [1]}
    assert with_salt(body, "s") == {"model": "m", "prompt": [1], "cache_salt": "s"}
    assert with_salt(body, None) == {"model": "m", "prompt": [1]}
    assert body["cache_salt"] == "mine"  # the client's body itself untouched


def test_a_pools_cache_scope_is_checked_and_kept_in_its_stored_body():
    assert PoolConfig(model="m").cache_scope == "team"
    with pytest.raises(ValueError, match="cache_scope"):
        PoolConfig(model="m", cache_scope="tenant")
    stored = pool_body(PoolConfig(model="m", cache_scope="shared"))
    assert stored["cache_scope"] == "shared" and pool_from_body(stored).cache_scope == "shared"
    with pytest.raises(ValueError, match="cache_scope"):
        pool_from_body({**stored, "cache_scope": "nobody"})


def test_the_strict_schema_types_cache_salt_as_a_non_empty_string():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert CHAT.validate_python({**chat, "cache_salt": "s"})["cache_salt"] == "s"
    for bad in ("", 5, ["s"]):
        with pytest.raises(ValidationError, match="cache_salt"):
            CHAT.validate_python({**chat, "cache_salt": bad})
        with pytest.raises(ValidationError, match="cache_salt"):
            COMPLETION.validate_python({"model": "m", "prompt": "x", "cache_salt": bad})


def _dispatcher(scope: str = "team") -> tuple[Dispatcher, Upstreams]:
    ups = [UpstreamConfig("http://e0:1", name="e0"), UpstreamConfig("http://x:1", name="x", engine=False)]
    pools = [PoolConfig(model="m", upstreams=ups[:1], cache_scope=scope), PoolConfig(model="ext", upstreams=ups[1:])]
    upstreams = Upstreams(GatewayConfig(pools=pools))
    inst = upstreams.pools["m"].instances[0]
    inst.load = _load()
    forget_evicted(inst, inst.load)
    # routing and bodies use no client, member slots, background tasks, token counts or settler
    return Dispatcher(GatewayConfig(), upstreams, None, Metrics(), None, None, None, None), upstreams


def _ctx(upstreams: Upstreams, team: str, key: str, model: str = "m", **body) -> ContextStandIn:
    return ContextStandIn(
        model=model,
        kind="completions",
        body={"model": model, "prompt": PROMPT, **body},
        route_reason=None,
        context_fallback=None,
        prompt_ids=None,  # admission counted no chat
        alias=None,  # no alias's variant (a canary's plan ends with its baseline)
        routes=upstreams.routes,
        pools=upstreams.pools,
        team_id=team,
        key_id=key,
        priority=1,
        kv_transfer_params=None,
    )


@pytest.mark.parametrize("client_salt", [None, "mine"])
def test_the_routers_hashes_are_the_engines_for_the_salt_the_body_carries(client_salt):
    dispatcher, upstreams = _dispatcher()
    ctx = _ctx(upstreams, "A", "a1", **({"cache_salt": client_salt} if client_salt else {}))
    hops, hashes = dispatcher.route(ctx)
    sent = dispatcher.upstream_body(ctx, hops[0])
    assert sent["cache_salt"] == cache_salt("team", "A", "a1", client_salt) and sent["priority"] == 1
    seq = Sequence("r", PROMPT, SamplingParams(cache_salt=sent["cache_salt"]))
    bm = BlockManager(num_blocks=32, block_size=16)
    assert bm.allocate_slots(seq, seq.num_tokens)
    assert hashes == seq.block_hashes != block_hashes(PROMPT, 16)


def test_another_team_sending_the_same_prompt_looks_up_other_hashes():
    dispatcher, upstreams = _dispatcher()
    _, a = dispatcher.route(_ctx(upstreams, "A", "a1"))
    _, a2 = dispatcher.route(_ctx(upstreams, "A", "a2"))
    _, b = dispatcher.route(_ctx(upstreams, "B", "b1"))
    assert a == a2 and not set(a) & set(b)
    shared, upstreams = _dispatcher("shared")
    _, sa = shared.route(_ctx(upstreams, "A", "a1"))
    _, sb = shared.route(_ctx(upstreams, "B", "b1"))
    assert sa == sb == block_hashes(PROMPT, 16, max_blocks=(len(PROMPT) - 1) // 16)


def test_an_external_member_is_sent_the_salt_too_and_a_shared_pool_sends_none():
    dispatcher, upstreams = _dispatcher()
    ctx = _ctx(upstreams, "A", "a1", model="ext", cache_salt="mine")
    (hop,) = dispatcher.route(ctx)[0]
    sent = dispatcher.upstream_body(ctx, hop)
    assert sent["cache_salt"] == cache_salt("team", "A", "a1", "mine") and "priority" not in sent
    shared, upstreams = _dispatcher("shared")
    ctx = _ctx(upstreams, "A", "a1")
    assert "cache_salt" not in shared.upstream_body(ctx, shared.route(ctx)[0][0])


def test_a_mirror_is_sent_with_the_primarys_salt():
    from tokenweir.gateway.request.shadow import ShadowMirror

    ups = [UpstreamConfig("http://e0:1", name="e0"), UpstreamConfig("http://s0:1", name="s0")]
    pools = [
        PoolConfig(model="m", upstreams=ups[:1], shadow_pool="s", shadow_fraction=1.0),
        PoolConfig(model="s", upstreams=ups[1:], cache_scope="shared"),
    ]
    upstreams = Upstreams(GatewayConfig(pools=pools))
    ctx = _ctx(upstreams, "A", "a1", cache_salt="mine")
    ctx.choices = 1
    mirror = ShadowMirror(GatewayConfig(), None, Metrics(), None, None).sample(ctx)
    assert mirror is not None and mirror.args[0].body["cache_salt"] == cache_salt("team", "A", "a1", "mine")


def test_a_team_finds_its_own_prefix_where_it_sent_it_and_another_team_only_the_prompts_home():
    """The home (where a prompt no engine holds goes) is the prompt's alone, so it tells B nothing; a hit is the
    salt's."""
    upstreams = _upstreams()
    a, b = cache_salt("team", "A", "a1"), cache_salt("team", "B", "b1")
    hops, why, hashes = upstreams.route("m", PROMPT, salt=a)
    upstreams.record(hops[0], hashes)
    home = hops[0].instance
    assert why.reason == "prefix_home"
    hops, why, _ = upstreams.route("m", PROMPT, salt=a)
    assert hops[0].instance is home and why.reason == "prefix_hit" and why.hit_blocks == 12
    hops, why, _ = upstreams.route("m", PROMPT, salt=b)
    assert hops[0].instance is home and why.reason == "prefix_home" and why.hit_blocks == 0
    assert upstreams.route("m", PROMPT)[0][0].instance is home  # the same home as before salts


def test_an_embedding_is_sent_no_salt_not_even_the_clients():
    dispatcher, upstreams = _dispatcher()
    ctx = _ctx(upstreams, "A", "a1", model="ext", cache_salt="mine")
    ctx.kind = "embeddings"
    (hop,) = dispatcher.route(ctx)[0]
    assert "cache_salt" not in dispatcher.upstream_body(ctx, hop)
