"""Costs accumulate exactly and are rounded once per report, through real HTTP: client -> gateway -> fake upstream.

At 1e-6 USD per 1M tokens a request of a few tokens is worth about 1e-11 USD: billed rounded up to a micro-dollar
each, a few hundred of them would read a thousand times their worth. The events, the usage report and the live spend
budget must all read the exact sum of what the upstream made.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.metrics import gateway_metrics
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.stack import events_of, team
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits
from tokenweir.policies.pricing import Prices, femtos_to_usd, usd_to_femtos

MODEL = "tiny"
PRICE = 1e-6  # USD per 1M tokens, input and output: 1,000 femto-USD a token
PROMPT = [101, 102, 103, 104, 105, 106]  # 6 token ids: the gateway's count and the upstream's agree exactly
REQUESTS = 300


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exact-cost")
    store = Store.open(f"sqlite:///{tmp}/store.db")
    admin_secret, _ = store.create_key(None, "admin", is_admin=True)
    with ServerThread(FakeUpstream(model=MODEL)) as upstream:
        pool = PoolConfig(
            model=MODEL,
            upstreams=[UpstreamConfig(upstream.url)],
            price_input_per_1m=PRICE,
            price_output_per_1m=PRICE,
            capacity=64,
            max_queued=4096,
        )
        config = GatewayConfig(
            port=0,
            pools=[pool],
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
        )
        with serve_app(config, store=store, state_backend=InMemoryState()) as gw:
            yield {"store": store, "url": gw.url, "events": tmp / "events.jsonl", "admin": admin_secret}
    store.close()


async def test_a_few_hundred_tiny_requests_are_billed_their_exact_sum_everywhere(stack):
    team_id, secret = team(stack, TeamLimits(usd_per_day=1.0))
    sem = asyncio.Semaphore(32)

    async def one(c: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": bool(i % 2), "fake": {"tokens": i % 9}}
        async with sem:
            r = await c.post("/v1/completions", json=body)
        return r.status_code

    headers = {"authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=stack["url"], headers=headers, timeout=30) as c:
        statuses = await asyncio.gather(*(one(c, i) for i in range(REQUESTS)))
    assert set(statuses) == {200}
    events = await asyncio.to_thread(events_of, stack, team_id, REQUESTS)
    assert len(events) == REQUESTS
    # what the upstream made, at the exact price: about 1e-11 USD a request
    tokens = sum(e["prompt_tokens"] + e["completion_tokens"] for e in events)
    exact_femtos = Prices(PRICE, PRICE).cost_femtos(tokens, 0)
    exact_usd = tokens * PRICE / 1e6
    assert exact_femtos == tokens * 1_000 and exact_usd < 1e-7

    def close(usd: float) -> bool:
        return abs(usd - exact_usd) <= 0.01 * exact_usd

    assert sum(usd_to_femtos(e["cost"]) for e in events) == exact_femtos and close(sum(e["cost"] for e in events))
    admin = {"authorization": f"Bearer {stack['admin']}"}
    deadline = time.monotonic() + 10
    while True:  # the usage rows land with the recorder's next flush
        r = httpx.get(
            stack["url"] + "/admin/usage", params={"team_id": team_id, "group_by": "key"}, headers=admin, timeout=30
        )
        total = r.json()["total"]
        if total["requests"] == REQUESTS or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert total["requests"] == REQUESTS and total["cost_usd"] == femtos_to_usd(exact_femtos)
    assert close(total["cost_usd"])
    live = httpx.get(stack["url"] + f"/admin/teams/{team_id}/state", headers=admin, timeout=30).json()["live"]
    assert live["day_usd"]["spent"] == femtos_to_usd(exact_femtos) and close(live["day_usd"]["spent"])
    assert live["day_usd"]["reserved"] == 0
    # the metrics say it too: cost by team and model, and every request's latency in its length slice
    metrics = gateway_metrics(stack["url"])
    assert close(metrics[("tokenweir_gateway_cost_usd_total", (("model", MODEL), ("team", team_id)))])
    sliced = (("model", MODEL), ("output_len", "0-64"), ("prompt_len", "0-256"))
    assert metrics[("tokenweir_gateway_e2e_seconds_count", sliced)] == REQUESTS
