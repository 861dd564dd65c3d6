"""A member removed without draining gets nothing new, also from requests queued before the change, through real HTTP
on two replicas sharing one store: requests wait for a pool of one dispatch slot (`capacity: 1`), or for members that
serve one request at a time (`max_parallel_requests: 1`), while the admin API removes one of the two members. Once
both replicas have applied the change, every request still waiting is served by the member that stayed (before: they
went on reaching the removed one, routed by the table they were admitted under)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, two_replicas
from tests.support.stack import team
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig

PER_REPLICA = 10
ANSWER_MS = 200  # each request's time at its member: PER_REPLICA of them queue well past the change


@pytest.fixture(params=["capacity", "max_parallel_requests"])
def replicas(tmp_path, request):
    removed, stays = FakeUpstream(model="m"), FakeUpstream(model="m")
    one_at_a_time = request.param == "max_parallel_requests"
    with ServerThread(removed) as u0, ServerThread(stays) as u1:

        def config(name: str) -> GatewayConfig:
            members = [
                UpstreamConfig(url, name=n, model="m", engine=False, max_parallel_requests=1 if one_at_a_time else None)
                for url, n in ((u0.url, "u0"), (u1.url, "u1"))
            ]
            return GatewayConfig(
                port=0,
                pools=[PoolConfig("m", members, capacity=64 if one_at_a_time else 1, route="round_robin")],
                events=EventsConfig(path=str(tmp_path / f"events-{name}.jsonl"), flush_interval_s=0.05),
                routing_poll_interval_s=0.1,
            )

        with two_replicas(tmp_path, config) as (store, gateways, admin):
            yield {"store": store, "gateways": gateways, "fakes": (removed, stays), "admin": admin}


def applied(gateway: ServerThread) -> bool:
    """The replica routes by a table without u0."""
    return gateway.app.state.services.upstreams.pools["m"].member("u0") is None


async def test_requests_queued_before_a_member_is_removed_never_reach_it_once_the_change_is_applied(replicas):
    _, secret = team(replicas)
    removed, stays = replicas["fakes"]
    gateways = replicas["gateways"]
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "fake": {"tokens": 4, "ttft_ms": ANSWER_MS}}
    clients = [
        httpx.AsyncClient(base_url=g.url, headers={"authorization": f"Bearer {secret}"}, timeout=30) for g in gateways
    ]
    try:
        sent = [asyncio.create_task(c.post("/v1/completions", json=body)) for c in clients for _ in range(PER_REPLICA)]
        deadline = time.monotonic() + 5  # they are queued, and both members have served some
        while removed.requests_seen == 0 or stays.requests_seen == 0:
            assert time.monotonic() < deadline, "both members should serve some of the queued requests"
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=gateways[0].url, headers=replicas["admin"], timeout=30) as admin:
            r = await admin.delete("/admin/pools/m/members/u0")  # no drain first
        assert r.status_code == 200 and [m["name"] for m in r.json()["members"]] == ["u1"], r.text
        deadline = time.monotonic() + 5
        while not all(applied(g) for g in gateways):
            assert time.monotonic() < deadline, "a replica did not apply the change within 5 s"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # a hop sent just before the change has arrived by now
        seen_at_change, stays_at_change = removed.requests_seen, stays.requests_seen
        answers = await asyncio.gather(*sent)
    finally:
        for c in clients:
            await c.aclose()
    assert [a.status_code for a in answers] == [200] * len(sent), [a.text for a in answers if a.status_code != 200]
    assert stays.requests_seen > stays_at_change, "requests were still queued at the change"
    assert removed.requests_seen == seen_at_change, "a queued request reached the removed member"
