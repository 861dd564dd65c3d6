"""Shadow traffic bounded by what the tenant paid for, through real HTTP: client -> gateway -> fake engines (our
engine's protocol: /abort answers with the usage made). A mirror is sent once its request has ended, asking at most
the output tokens the request was billed (per choice), at priority 2 whatever the client's; a request that made
nothing is not mirrored; and the bound on mirrors in flight is per shadow pool, so a hung one starves no other."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.metrics import gateway_metrics
from tests.support.raw_upstream import silent_port
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.stack import events_of, team
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.request import shadow as shadow_module
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

PROMPT = [101, 102, 103, 104]
HUNG_S = 6.0  # how long a mirror to the hung pool waits (its primary pool's total limit)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shadow-bounds")
    store = Store.open(f"sqlite:///{tmp}/store.db")
    primary, shadow, live = FakeUpstream(model="m"), FakeUpstream(model="m"), FakeUpstream(model="m")
    with silent_port() as hung, ServerThread(primary) as p, ServerThread(shadow) as s, ServerThread(live) as lv:

        def mirrored(model: str, to: str, **kw) -> PoolConfig:
            return PoolConfig(model, [UpstreamConfig(p.url, model="m")], shadow_pool=to, shadow_fraction=1.0, **kw)

        pools = [
            mirrored("m", "mirror"),
            PoolConfig("mirror", [UpstreamConfig(s.url, model="m")]),
            mirrored("to-hung", "hung", total_timeout_s=HUNG_S),
            PoolConfig("hung", [UpstreamConfig(f"http://127.0.0.1:{hung}", model="m", engine=False)]),
            mirrored("to-live", "live"),
            PoolConfig("live", [UpstreamConfig(lv.url, model="m")]),
        ]
        config = GatewayConfig(
            port=0, pools=pools, events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05)
        )
        with serve_app(config, store=store, state_backend=InMemoryState()) as gw:
            yield {"store": store, "url": gw.url, "events": tmp / "events.jsonl", "primary": primary, "shadow": shadow}
    store.close()


def shadow_metric(stack, name: str, labels: dict) -> float:
    return gateway_metrics(stack["url"]).get((f"tokenweir_gateway_shadow_{name}", tuple(sorted(labels.items()))), 0.0)


def mirrored(stack, model: str, shadow: str, status: str) -> float:
    return shadow_metric(stack, "requests_total", {"model": model, "shadow": shadow, "status": status})


def wait_for(stack, model: str, shadow: str, status: str, n: float) -> None:
    deadline = time.monotonic() + 15
    while mirrored(stack, model, shadow, status) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mirrored(stack, model, shadow, status) == n, (model, shadow, status)


def client(stack, secret: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=stack["url"], headers={"authorization": f"Bearer {secret}"}, timeout=30,
        limits=httpx.Limits(max_connections=32),
    )  # fmt: skip


async def leave_after_first_chunk(c: httpx.AsyncClient, body: dict) -> None:
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                break  # the client goes: the response is closed unread


async def test_mirrors_of_20_streams_left_after_one_chunk_ask_only_what_was_billed_at_priority_2(stack):
    primary, shadow = stack["primary"], stack["shadow"]
    primary.received.clear()
    shadow.received.clear()
    shadow.records.clear()
    made_before = shadow_metric(stack, "tokens_total", {"kind": "completion", "model": "m", "shadow": "mirror"})
    ok_before = mirrored(stack, "m", "mirror", "ok")
    team_id, secret = team(stack, TeamLimits(tokens_per_day=1_000_000, priority=0))  # a critical team
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 400, "stream": True, "fake": {"tokens": 400, "itl_ms": 10}}
    async with client(stack, secret) as c:
        await asyncio.gather(*(leave_after_first_chunk(c, body) for _ in range(20)))
    events = await asyncio.to_thread(events_of, stack, team_id, 20)
    assert len(events) == 20 and {e["reason"] for e in events} == {"client_disconnected"}, events
    billed = sorted(e["completion_tokens"] for e in events)
    assert all(0 < b < 400 for b in billed), billed  # what was made before the engine was stopped
    await asyncio.to_thread(wait_for, stack, "m", "mirror", "ok", ok_before + 20)
    bodies = [b for _, b in shadow.received]
    assert len(bodies) == 20 and sorted(b["max_tokens"] for b in bodies) == billed
    made = sum(r.completion_tokens for r in shadow.records.values())
    assert made <= sum(billed), (made, billed)  # the shadow pool made no more than the tenant paid for
    made_metric = shadow_metric(stack, "tokens_total", {"kind": "completion", "model": "m", "shadow": "mirror"})
    assert made_metric - made_before == made
    assert {b["priority"] for b in bodies} == {2} and not any("stream" in b for b in bodies)
    assert {b["priority"] for _, b in primary.received} == {0}  # the primary ran at the team's own


async def test_a_mirror_splits_the_billed_output_over_its_choices_and_nothing_made_is_not_mirrored(stack):
    shadow = stack["shadow"]
    shadow.received.clear()
    ok, skipped = mirrored(stack, "m", "mirror", "ok"), mirrored(stack, "m", "mirror", "skipped")
    _, secret = team(stack)
    async with client(stack, secret) as c:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 10, "n": 2, "fake": {"tokens": 3}}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
        await asyncio.to_thread(wait_for, stack, "m", "mirror", "ok", ok + 1)
        ((_, sent),) = list(shadow.received)
        assert (sent["max_tokens"], sent["n"]) == (3, 2)  # 6 billed over 2 choices, not the 10 asked
        r = await c.post("/v1/completions", json={**body, "fake": {"tokens": 0}})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0, r.text
        await asyncio.to_thread(wait_for, stack, "m", "mirror", "skipped", skipped + 1)
    assert len(shadow.received) == 1  # the empty answer sent nothing to the shadow pool


async def test_a_hung_shadow_pool_does_not_starve_another_pools_mirrors(stack, monkeypatch):
    monkeypatch.setattr(shadow_module, "SHADOWS_IN_FLIGHT", 4)
    _, secret = team(stack)
    body = {"prompt": PROMPT, "max_tokens": 3, "fake": {"tokens": 3}}
    async with client(stack, secret) as c:
        started = time.monotonic()
        answers = await asyncio.gather(
            *(c.post("/v1/completions", json={**body, "model": "to-hung"}) for _ in range(6))
        )
        assert [r.status_code for r in answers] == [200] * 6
        await asyncio.to_thread(wait_for, stack, "to-hung", "hung", "dropped", 2)  # 4 hang, the bound is reached
        for i in range(10):  # one at a time: each mirror is in flight alone on its pool
            r = await c.post("/v1/completions", json={**body, "model": "to-live"})
            assert r.status_code == 200, r.text
            await asyncio.to_thread(wait_for, stack, "to-live", "live", "ok", i + 1)
    assert time.monotonic() - started < HUNG_S  # while the hung pool's 4 still waited
    assert mirrored(stack, "to-live", "live", "dropped") == 0
    assert mirrored(stack, "to-hung", "hung", "timeout") == 0
