"""One tenant's prefix cache is its own, through the gateway and a real engine (a tiny random Llama in this process):
team B's exact guess of team A's system prompt finds no more of it cached than a wrong guess does, and is not routed
as a prefix hit, while team A's own requests, from any of its keys, reuse it. A pool with `cache_scope: key` keeps
each key's own; one with `cache_scope: shared` (put through the admin API) shares across teams; a client's own
cache_salt cannot reach another team's cache."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.events import the_event
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.tiny_llama import make_tiny_llama
from tokenweir.engine.api import build_app
from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.async_engine import AsyncEngine
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.request.cache_scope import cache_salt
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

BLOCK = 16
SECRET = [(37 * i + 11) % 240 + 3 for i in range(7 * BLOCK)]  # team A's confidential system prompt: 7 blocks
WRONG = [(53 * i + 29) % 240 + 3 for i in range(7 * BLOCK)]  # a wrong guess of it


def suffix(n: int) -> list[int]:
    return [(n * 31 + i * 7) % 240 + 3 for i in range(15)]  # a question after it: 127 tokens in all


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache-scope")
    model = make_tiny_llama(str(tmp / "tiny"), seed=7, max_position_embeddings=256)
    engine = LLMEngine(
        EngineConfig(
            model=model, served_model_name="tiny", num_kv_blocks=128, quantization="none", num_threads=1,
            dtype="float32",
        )
    )  # fmt: skip
    store = Store.open(f"sqlite:///{tmp}/store.db")
    team_a, team_b = store.create_team("a", TeamLimits()), store.create_team("b", TeamLimits())
    keys = {
        "a1": store.create_key(team_a.id, "a1")[0],
        "a2": store.create_key(team_a.id, "a2")[0],
        "b1": store.create_key(team_b.id, "b1")[0],
    }
    admin, _ = store.create_key(None, "admin", is_admin=True)
    events = tmp / "events.jsonl"
    with ServerThread(build_app(AsyncEngine(engine))) as eng:
        pools = [
            PoolConfig(model="tiny", upstreams=[UpstreamConfig(eng.url, name="e0")]),
            PoolConfig(
                model="tiny-key", upstreams=[UpstreamConfig(eng.url, name="e0", model="tiny")], cache_scope="key"
            ),
        ]
        config = GatewayConfig(port=0, pools=pools, events=EventsConfig(path=str(events), flush_interval_s=0.05))
        with serve_app(config, store=store) as gw:
            upstreams = gw.app.state.services.upstreams
            deadline = time.monotonic() + 10
            while upstreams.pools["tiny"].block_size() != BLOCK:  # the poller has read the engine's /load
                assert time.monotonic() < deadline, "the engine's /load was never polled"
                time.sleep(0.05)
            with httpx.Client(base_url=gw.url, timeout=60) as client:
                yield {
                    "client": client,
                    "keys": keys,
                    "admin": admin,
                    "events": events,
                    "engine_url": eng.url,
                    "team_a": team_a.id,
                }
    store.close()


def send(stack, key: str, prompt: list[int], model: str = "tiny", **extra) -> tuple[int, dict]:
    """The request's cached prompt tokens, and the route reason its event records."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, **extra}
    r = stack["client"].post("/v1/completions", json=body, headers={"authorization": f"Bearer {stack['keys'][key]}"})
    assert r.status_code == 200, r.text
    event = the_event(stack["events"], r.headers["x-request-id"])
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], event["route_reason"]


def test_team_b_guessing_team_as_system_prompt_finds_no_more_cached_than_a_wrong_guess(stack):
    prompt = SECRET + suffix(1)
    assert send(stack, "a1", prompt)[0] == 0
    own, own_route = send(stack, "a1", SECRET + suffix(2))
    other_key, other_key_route = send(stack, "a2", SECRET + suffix(3))
    assert own >= 0.7 * len(prompt) and other_key >= 0.7 * len(prompt), (own, other_key)
    assert own_route["hit_blocks"] == other_key_route["hit_blocks"] == 7  # routed to where team A's prefix is
    right, right_route = send(stack, "b1", SECRET + suffix(4))
    wrong, _ = send(stack, "b1", WRONG + suffix(5))
    assert abs(right - wrong) < BLOCK, (right, wrong)
    assert right_route["hit_blocks"] == 0 and right_route["reason"] != "prefix_hit"


def test_a_client_cache_salt_cannot_make_team_b_hit_team_as_cache(stack):
    send(stack, "a1", SECRET + suffix(6))  # team A's prefix is cached (again, whatever ran before)
    for salt in (cache_salt("team", stack["team_a"], "a1"), stack["team_a"], "a"):
        cached, route = send(stack, "b1", SECRET + suffix(7), cache_salt=salt)
        assert cached < BLOCK and route["hit_blocks"] == 0, (salt, cached)
    # a client salt narrows team A's own scope too: a different salt, a different cache
    assert send(stack, "a1", SECRET + suffix(8), cache_salt="project-x")[0] == 0
    assert send(stack, "a1", SECRET + suffix(9), cache_salt="project-x")[0] >= 7 * BLOCK
    r = stack["client"].post(
        "/v1/completions",
        json={"model": "tiny", "prompt": SECRET, "max_tokens": 1, "cache_salt": ""},
        headers={"authorization": f"Bearer {stack['keys']['b1']}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_a_key_scoped_pool_keeps_each_keys_cache_its_own(stack):
    prompt = SECRET + suffix(10)
    assert send(stack, "a1", prompt, model="tiny-key")[0] == 0  # the team's cache is not the key's either
    assert send(stack, "a1", SECRET + suffix(11), model="tiny-key")[0] >= 7 * BLOCK
    assert send(stack, "a2", SECRET + suffix(12), model="tiny-key")[0] < BLOCK


def test_a_shared_pool_put_through_the_admin_api_shares_its_cache_across_teams(stack):
    client, admin = stack["client"], {"authorization": f"Bearer {stack['admin']}"}
    member = {"base_url": stack["engine_url"], "name": "e0", "model": "tiny"}
    bad = {"model": "tiny-shared", "upstreams": [member], "cache_scope": "everyone"}
    r = client.put("/admin/pools/tiny-shared", json=bad, headers=admin)
    assert r.status_code == 400 and "cache_scope" in r.text, r.text
    r = client.put("/admin/pools/tiny-shared", json={**bad, "cache_scope": "shared"}, headers=admin)
    assert r.status_code == 200 and r.json()["config"]["cache_scope"] == "shared", r.text
    deadline = time.monotonic() + 5
    while True:  # the new pool is in the routing table
        body = {"model": "tiny-shared", "prompt": [5, 6, 7], "max_tokens": 1}
        r = client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {stack['keys']['a1']}"})
        if r.status_code == 200:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)
    send(stack, "a1", SECRET + suffix(13), model="tiny-shared")
    assert send(stack, "b1", SECRET + suffix(14), model="tiny-shared")[0] >= 7 * BLOCK
