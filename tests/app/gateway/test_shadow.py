"""Shadow traffic, through real HTTP: client -> gateway -> fake upstreams. A pool mirrors a sampled fraction of its
requests to a shadow pool: the client's answer and bill are the primary's alone (one event, the team's usage), the
shadow's requests, latency and tokens go to the shadow metrics only, and a shadow that fails or hangs changes
nothing for the client."""

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
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store

PROMPT = [101, 102, 103, 104]


@pytest.fixture(scope="module")
def hung_port():
    with silent_port() as port:
        yield port


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hung_port):
    tmp = tmp_path_factory.mktemp("shadow")
    store = Store.open(f"sqlite:///{tmp}/store.db")
    primary, shadow = FakeUpstream(model="m"), FakeUpstream(model="m")
    with ServerThread(primary) as p, ServerThread(shadow) as s:
        pools = [
            PoolConfig(model="all", upstreams=[UpstreamConfig(p.url, model="m")], shadow_pool="mirror",
                       shadow_fraction=1.0),
            PoolConfig(model="half", upstreams=[UpstreamConfig(p.url, model="m")], shadow_pool="mirror",
                       shadow_fraction=0.5),
            PoolConfig(model="mirror", upstreams=[UpstreamConfig(s.url, model="m")]),
            PoolConfig(model="to-hung", upstreams=[UpstreamConfig(p.url, model="m")], shadow_pool="hung",
                       shadow_fraction=1.0, total_timeout_s=1.0),
            PoolConfig(model="hung", upstreams=[UpstreamConfig(f"http://127.0.0.1:{hung_port}", model="m")]),
        ]  # fmt: skip
        config = GatewayConfig(
            port=0, pools=pools, events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05)
        )
        with serve_app(config, store=store, state_backend=InMemoryState()) as gw:
            yield {"store": store, "url": gw.url, "events": tmp / "events.jsonl", "primary": primary, "shadow": shadow}
    store.close()


def shadow_count(stack, model: str, status: str, shadow: str = "mirror") -> float:
    labels = (("model", model), ("shadow", shadow), ("status", status))
    return gateway_metrics(stack["url"]).get(("tokenweir_gateway_shadow_requests_total", labels), 0.0)


def wait_for_shadows(stack, model: str, status: str, n: float, shadow: str = "mirror") -> None:
    deadline = time.monotonic() + 10
    while shadow_count(stack, model, status, shadow) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shadow_count(stack, model, status, shadow) == n


async def run(stack, model: str, n: int, stream: bool = False) -> tuple[str, list[int]]:
    team_id, secret = team(stack)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "stream": stream, "fake": {"tokens": 3}}
    async with httpx.AsyncClient(base_url=stack["url"], headers={"authorization": f"Bearer {secret}"}) as c:
        statuses = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(n)))
    return team_id, [r.status_code for r in statuses]


async def test_every_request_mirrored_is_billed_once_and_counted_apart(stack):
    before = len(stack["shadow"].records)
    team_id, statuses = await run(stack, "all", 20)
    assert statuses == [200] * 20
    events = await asyncio.to_thread(events_of, stack, team_id, 20)
    assert len(events) == 20 and all(e["served_model"] == "all" and e["completion_tokens"] == 3 for e in events)
    await asyncio.to_thread(wait_for_shadows, stack, "all", "ok", 20)
    assert len(stack["shadow"].records) - before == 20
    made = (("kind", "completion"), ("model", "all"), ("shadow", "mirror"))
    assert gateway_metrics(stack["url"])[("tokenweir_gateway_shadow_tokens_total", made)] == 60  # 20 x 3 tokens
    half_before = shadow_count(stack, "half", "ok")
    _, statuses = await run(stack, "half", 200, stream=True)
    assert statuses == [200] * 200
    await asyncio.sleep(1.0)
    assert 60 <= shadow_count(stack, "half", "ok") - half_before <= 140  # about half of 200 sampled


async def test_a_failing_or_hung_shadow_changes_nothing_for_the_client(stack):
    stack["shadow"].down = True
    try:
        errors = shadow_count(stack, "all", "error")
        _, statuses = await run(stack, "all", 10)
        assert statuses == [200] * 10
        await asyncio.to_thread(wait_for_shadows, stack, "all", "error", errors + 10)
    finally:
        stack["shadow"].down = False
    # a mirror that never answers: the client has its answer while the mirror still waits (its pool's 1 s limit)
    _, statuses = await run(stack, "to-hung", 1)
    assert statuses == [200]
    assert shadow_count(stack, "to-hung", "timeout", "hung") == 0
    await asyncio.to_thread(wait_for_shadows, stack, "to-hung", "timeout", 1, "hung")
