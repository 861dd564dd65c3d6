"""Spend budgets across fallback hops and the bill of streams cut on external pools, on both state backends
(InMemoryState, RedisState on the real Redis), through real HTTP: client -> gateway -> fake upstreams.

A request may be served by any hop of its route plan, and is billed at the serving pool's prices, so admission holds
the dearest hop's cost: a primary that is unpriced (or cheap) and down cannot let a USD budget be overrun by its
priced fallback. A stream an external upstream never finished is billed at the reservation's bound, not at the text
relayed before the cut, and every event says how its usage was obtained (`usage_source`).
"""

from __future__ import annotations

import asyncio
import math
import time

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
from tokenweir.policies.pricing import Prices, max_cost_over

PROMPT = [101, 102, 103, 104, 105, 106]  # 6 token ids: the gateway's count and the upstream's agree exactly
PRICE_IN, PRICE_OUT = 10.0, 20.0  # the fallback pool's, USD per 1M tokens (= micro-USD per token)


@pytest.fixture(scope="module", params=["memory", "redis"])
def stack(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"billing-{request.param}")
    prefix = fresh_redis_prefix() if request.param == "redis" else None
    state = InMemoryState() if prefix is None else RedisState(URL, prefix=prefix)
    store = Store.open(f"sqlite:///{tmp}/store.db")
    down, live = FakeUpstream(), FakeUpstream()
    down.down = True  # every request to it answers 503: the route plan goes on to the fallback
    with ServerThread(down) as dead, ServerThread(live) as alive:

        def external(url: str) -> list[UpstreamConfig]:
            return [UpstreamConfig(url, engine=False)]

        pools = [
            PoolConfig(model="free", upstreams=external(dead.url), fallbacks=["priced"]),
            PoolConfig(
                model="cheap",
                upstreams=external(dead.url),
                fallbacks=["priced"],
                price_input_per_1m=0.1,
                price_output_per_1m=0.1,
            ),
            PoolConfig(
                model="priced",
                upstreams=external(alive.url),
                price_input_per_1m=PRICE_IN,
                price_output_per_1m=PRICE_OUT,
            ),
            PoolConfig(model="ext", upstreams=external(alive.url)),
            PoolConfig(model="flaky", upstreams=external(alive.url)),  # its breaks open its own circuit only
            PoolConfig(model="eng", upstreams=[UpstreamConfig(alive.url)]),  # our engine's protocol: /abort
        ]
        for pool in pools:
            pool.capacity, pool.max_queued = 64, 4096
        config = GatewayConfig(
            port=0,
            pools=pools,
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
        )
        with serve_app(config, store=store, state_backend=state) as gw:
            yield {"store": store, "url": gw.url, "events": tmp / "events.jsonl", "fake": live, "app": gw.app, "gw": gw}
    store.close()
    if prefix is not None:
        drop_redis_prefix(prefix)


def made(stack, event: dict) -> tuple[int, int]:
    """What the upstream itself counts for the request: (prompt, completion), once it stopped generating."""
    record = stack["fake"].records[event["upstream_request_id"]]
    deadline = time.monotonic() + 10
    while record.status == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    return record.prompt_tokens, record.completion_tokens


def client(stack, secret: str, n: int = 8, timeout: float = 30) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {secret}"}
    limits = httpx.Limits(max_connections=n)
    return httpx.AsyncClient(base_url=stack["url"], headers=headers, timeout=timeout, limits=limits)


def test_the_reservation_holds_the_dearest_pool_of_the_route_plan():
    priced, cheap = Prices(PRICE_IN, PRICE_OUT), Prices(0.1, 0.1)
    assert max_cost_over([None, priced], 6, 100) == 6 * 10 + 100 * 20
    assert max_cost_over([cheap, priced], 6, 100) == max_cost_over([priced, cheap], 6, 100) == 2060
    assert max_cost_over([None, None], 6, 100) == 0
    # the dearest pool's whole bound, not the dearest input price with another pool's output price
    assert max_cost_over([Prices(100.0, 0.0), Prices(0.0, 10.0)], 10, 10) == 1000


@pytest.mark.parametrize("primary", ["free", "cheap"])
async def test_a_down_primary_falling_back_to_a_priced_pool_keeps_a_usd_budget(stack, primary):
    budget_micros = 10_000
    team_id, secret = team(stack, TeamLimits(usd_per_day=budget_micros / 1e6))
    per_request = len(PROMPT) * PRICE_IN + 100 * PRICE_OUT  # what one request can cost on the fallback
    body = {"model": primary, "prompt": PROMPT, "max_tokens": 100, "fake": {"tokens": 100, "ttft_ms": 100}}
    async with client(stack, secret, n=30) as c:
        results = await asyncio.gather(
            *(c.post("/v1/completions", json={**body, "stream": bool(i % 2)}) for i in range(30))
        )
    assert {r.status_code for r in results} <= {200, 429}, [r.text for r in results if r.status_code not in (200, 429)]
    refusals = [r.json()["error"]["code"] for r in results if r.status_code == 429]
    assert refusals and set(refusals) == {"budget_exhausted"}
    events = events_of(stack, team_id, 30)
    served = [e for e in events if e["status"] == "ok"]
    assert served and all(e["served_model"] == "priced" for e in served), events
    # at the fallback's prices, from the upstream's own counts: the budget, overshot by at most one reservation
    cost = sum(math.ceil(p * PRICE_IN + c * PRICE_OUT) for p, c in (made(stack, e) for e in served))
    assert 0 < cost <= budget_micros + per_request, (cost, len(served))
    assert sum(round(e["cost"] * 1e6) for e in served) == cost
    assert {e["usage_source"] for e in served} == {"upstream"}


async def read_then_cut(c: httpx.AsyncClient, body: dict, chunks: int) -> int:
    got = 0
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            got += line.startswith("data:")
            if got == chunks:
                break
    return got


async def test_streams_an_external_pool_never_finished_are_billed_the_reservation_bound(stack):
    team_id, secret = team(stack)
    body = {"model": "ext", "prompt": PROMPT, "max_tokens": 40, "n": 4, "stream": True}
    knobs = {"tokens": 40, "itl_ms": 20}
    async with client(stack, secret) as c:
        # 8 streams of n=4 the client leaves after 6 chunks, 4 that break upstream, 4 past the team's total timeout
        cut = [read_then_cut(c, {**body, "fake": knobs}, 6) for _ in range(8)]
        flaky = {**body, "model": "flaky", "fake": {**knobs, "fail_after": 5}}
        broken = [read_then_cut(c, flaky, 10**6) for _ in range(4)]
        await asyncio.gather(*cut, *broken)
    slow_id, slow_secret = team(stack, TeamLimits(total_timeout_s=0.5))
    async with client(stack, slow_secret) as c:
        timed_out = [read_then_cut(c, {**body, "fake": {**knobs, "itl_ms": 100}}, 10**6) for _ in range(4)]
        await asyncio.gather(*timed_out)
    events = events_of(stack, team_id, 12) + events_of(stack, slow_id, 4)
    reasons = sorted(e["reason"] for e in events)
    assert reasons == ["client_disconnected"] * 8 + ["total_timeout"] * 4 + ["upstream_broken"] * 4, reasons
    for e in events:
        prompt, completion = made(stack, e)
        assert e["usage_source"] == "reservation_bound", e
        assert (e["prompt_tokens"], e["completion_tokens"], e["max_tokens"]) == (6, 160, 160), e
        assert e["completion_tokens"] >= completion and e["prompt_tokens"] >= prompt, (e, completion)
    spent = stack["gw"].call(stack["app"].state.services.state.snapshot(team_id))["spent_today"]
    assert spent == 12 * (6 + 160)


async def test_every_event_names_how_its_usage_was_obtained(stack):
    team_id, secret = team(stack)
    ext = {"model": "ext", "prompt": PROMPT, "max_tokens": 40}
    async with client(stack, secret) as c:
        whole = await c.post("/v1/completions", json={**ext, "stream": True, "fake": {"tokens": 8}})
        silent = await c.post("/v1/completions", json={**ext, "stream": True, "fake": {"tokens": 8, "usage": False}})
        plain = await c.post("/v1/completions", json={**ext, "fake": {"tokens": 8}})
        engine = {**ext, "model": "eng", "stream": True, "fake": {"tokens": 40, "itl_ms": 20}}
        await read_then_cut(c, engine, 3)
        unknown = await c.post("/v1/completions", json={**ext, "model": "nope"})
    assert [r.status_code for r in (whole, silent, plain, unknown)] == [200, 200, 200, 404]
    events = events_of(stack, team_id, 5)
    by = {(e["model"], e["stream"], e["status"]): e for e in events}
    assert by[("ext", False, "ok")]["usage_source"] == "upstream"
    streamed = sorted(
        (e["usage_source"], e["completion_tokens"]) for e in events if e["model"] == "ext" and e["stream"]
    )
    # the stream without usage relayed all of its text: what was made, counted by the gateway (an estimate)
    assert [s for s, _ in streamed] == ["estimate_text", "upstream"] and streamed[1][1] == 8, streamed
    cut = by[("eng", True, "cancelled")]
    assert cut["usage_source"] == "engine_abort" and cut["completion_tokens"] == made(stack, cut)[1] < 40, cut
    assert by[("nope", False, "rejected")]["usage_source"] is None
