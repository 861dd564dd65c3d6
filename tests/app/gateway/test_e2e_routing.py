"""Priority, fairness, queue shedding, fallback hops and circuit breaking through the HTTP path."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.support.serve_thread import ServerThread, serve_app
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import BreakerConfig, EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import PRIORITY_BATCH, PRIORITY_CRITICAL, TeamLimits

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routing")
    fake, down = FakeUpstream(model="m"), FakeUpstream(model="m", down=True)
    store = Store.open(f"sqlite:///{tmp}/store.db")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    with ServerThread(fake) as up, ServerThread(down) as up_down:
        config = GatewayConfig(
            port=0,
            pools=[
                PoolConfig(model="serial", upstreams=[UpstreamConfig(up.url)], capacity=1, max_queued=100),
                PoolConfig(model="tiny", upstreams=[UpstreamConfig(up.url)], capacity=1, max_queued=2),
                PoolConfig(model="backup", upstreams=[UpstreamConfig(up.url, name="good")]),
                PoolConfig(model="primary", upstreams=[UpstreamConfig(dead, name="dead")], fallbacks=["backup"]),
                PoolConfig(
                    model="flaky",
                    upstreams=[UpstreamConfig(up_down.url, name="down"), UpstreamConfig(up.url, name="up")],
                ),
                PoolConfig(model="gone", upstreams=[UpstreamConfig(up_down.url, name="down-only")]),
                PoolConfig(
                    model="twice", upstreams=[UpstreamConfig(up.url, name="a"), UpstreamConfig(up.url, name="b")]
                ),
                PoolConfig(model="hangs", upstreams=[UpstreamConfig(up.url, name="slow")], ttft_timeout_s=0.2),
                PoolConfig(model="hangs-for-a-team", upstreams=[UpstreamConfig(up.url, name="slow")]),
            ],
            breaker=BreakerConfig(failures=3, cooldown_s=60),
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
        )
        admin, _ = store.create_key(None, "ops", is_admin=True)  # /health lists instances to an admin only
        with serve_app(config, store=store) as gw:
            yield {
                "fake": fake,
                "store": store,
                "url": gw.url,
                "events": tmp / "events.jsonl",
                "app": gw.app,
                "gw": gw,
                "admin": {"authorization": f"Bearer {admin}"},
            }
    store.close()


def make_team(stack, **limits):
    team = stack["store"].create_team(f"team-{time.monotonic_ns()}", TeamLimits(**limits))
    secret, _ = stack["store"].create_key(team.id, "test")
    return team, openai.AsyncOpenAI(base_url=stack["url"] + "/v1", api_key=secret, max_retries=0, timeout=30)


def events_by_id(stack) -> dict[str, dict]:
    return {e["request_id"]: e for e in read_events(stack["events"])}


async def wait_events(stack, ids: list[str], timeout=5.0) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        events = events_by_id(stack)
        if all(i in events for i in ids) or time.monotonic() > deadline:
            return events
        await asyncio.sleep(0.02)


async def call(client, model: str, ttft_ms: int = 0) -> str:
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=1, extra_body={"fake": {"ttft_ms": ttft_ms}}
    )
    return raw.headers["x-request-id"]


async def dispatch_order(stack, launches: list[tuple]) -> list[str]:
    """Hold the single slot with a blocker, queue `launches` in order, return the teams in dispatch order."""
    _, blocker_client = make_team(stack)
    blocker = asyncio.ensure_future(call(blocker_client, "serial", ttft_ms=1000))  # ample time to queue all
    await asyncio.sleep(0.15)
    tasks = []
    for client, _team in launches:
        tasks.append(asyncio.ensure_future(call(client, "serial", ttft_ms=5)))
        await asyncio.sleep(0.005)  # arrival order is the launch order
    ids = await asyncio.gather(*tasks)
    await blocker
    events = await wait_events(stack, ids)
    # the upstream knows each request by the gateway's own id for it, not the client's x-request-id
    teams = {events[rid]["upstream_request_id"]: team for rid, (_, team) in zip(ids, launches, strict=True)}
    dispatched = [uid for uid in stack["fake"].records if uid in teams]  # records keep arrival order upstream
    return [teams[rid] for rid in dispatched]


async def test_higher_band_always_dispatches_first(stack):
    batch, batch_client = make_team(stack, priority=PRIORITY_BATCH)
    crit, crit_client = make_team(stack, priority=PRIORITY_CRITICAL)
    launches = [(batch_client, batch.id)] * 6 + [(crit_client, crit.id)] * 6
    order = await dispatch_order(stack, launches)
    assert order == [crit.id] * 6 + [batch.id] * 6


async def test_weights_1_to_3_share_dispatches_within_10_percent(stack):
    light, light_client = make_team(stack, weight=1)
    heavy, heavy_client = make_team(stack, weight=3)
    launches = [(light_client, light.id), (heavy_client, heavy.id)] * 16
    order = await dispatch_order(stack, launches)
    first = order[:16]  # while both teams still have waiters
    share = first.count(heavy.id) / len(first)
    assert abs(share - 0.75) <= 0.075, order


async def test_queue_bound_and_deadline_shed_with_reasons(stack):
    _, blocker_client = make_team(stack)
    _, client = make_team(stack, queue_timeout_s=0.2)
    blocker = asyncio.ensure_future(call(blocker_client, "tiny", ttft_ms=800))
    await asyncio.sleep(0.15)
    waiting = [asyncio.ensure_future(call(client, "tiny")) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(openai.RateLimitError) as full:
        await call(client, "tiny")
    assert full.value.code == "queue_full" and int(full.value.response.headers["retry-after"]) >= 1
    for w in waiting:
        with pytest.raises(openai.InternalServerError) as late:
            await w
        assert late.value.status_code == 503 and late.value.code == "queue_timeout"
        assert int(late.value.response.headers["retry-after"]) >= 1
    await blocker
    events = await wait_events(stack, [full.value.response.headers["x-request-id"]])
    assert events[full.value.response.headers["x-request-id"]]["reason"] == "queue_full"
    assert stack["app"].state.services.queues["tiny"].stats()["in_use"] == 0


async def test_fallback_hop_before_first_byte_and_breaker_opens(stack):
    _, client = make_team(stack)
    ids = [await call(client, "primary") for _ in range(4)]
    events = await wait_events(stack, ids)
    routes = [events[i]["route"] for i in ids]
    assert routes[:3] == [["primary@dead", "backup@good"]] * 3
    assert routes[3] == ["backup@good"], "after 3 failures the dead instance's circuit is open: not tried"
    assert all(events[i]["status"] == "ok" and events[i]["instance"] == "backup@good" for i in ids)
    async with httpx.AsyncClient(base_url=stack["url"], headers=stack["admin"]) as http:
        health = (await http.get("/health")).json()
    assert health["pools"]["primary"][0]["circuit"] == "open"


async def test_5xx_instance_is_skipped_within_the_pool(stack):
    _, client = make_team(stack)
    rid = await call(client, "flaky")
    events = await wait_events(stack, [rid])
    assert events[rid]["route"] == ["flaky@down", "flaky@up"]


async def test_no_upstream_left_is_503_upstream_unavailable(stack):
    _, client = make_team(stack)
    with pytest.raises(openai.InternalServerError) as exc:
        await call(client, "gone")
    assert exc.value.status_code == 503 and exc.value.code == "upstream_unavailable"
    assert exc.value.response.headers["retry-after"]


async def test_client_leaving_while_queued_never_reaches_the_upstream(stack):
    team, blocker_client = make_team(stack)
    _, client = make_team(stack)
    blocker = asyncio.ensure_future(call(blocker_client, "serial", ttft_ms=600))
    await asyncio.sleep(0.15)
    impatient = client.with_options(timeout=0.2)
    with pytest.raises(openai.APITimeoutError):
        await impatient.completions.create(
            model="serial", prompt=PROMPT, max_tokens=1, extra_headers={"x-request-id": "gone-while-queued"}
        )
    events = await wait_events(stack, ["gone-while-queued"])
    event = events["gone-while-queued"]
    assert (event["status"], event["reason"], event["route"]) == ("cancelled", "client_disconnected", [])
    assert event["client_disconnected"] and event["completion_tokens"] == 0
    assert stack["app"].state.services.queues["serial"].stats()["queued"] == 0, "the waiter left no trace"
    await blocker
    assert event["upstream_request_id"] is None, "a request that never left the queue reached no upstream"
    snap = stack["gw"].call(stack["app"].state.services.state.snapshot(event["team"]))
    assert snap["reserved_tokens"] == 0 and snap["in_flight"] == 0


async def test_stream_failing_before_its_first_token_is_aborted_and_its_prefill_billed(stack):
    _, client = make_team(stack)
    aborts_before = len(stack["fake"].aborts)
    with pytest.raises(openai.InternalServerError) as exc:
        await client.completions.create(
            model="twice",
            prompt=PROMPT,
            max_tokens=5,
            stream=True,
            extra_body={"fake": {"fail_after": 0}},  # headers, then the connection drops: no token
            extra_headers={"x-request-id": "fails-twice"},
        )
    assert exc.value.status_code == 503 and exc.value.code == "upstream_unavailable"
    event = (await wait_events(stack, ["fails-twice"]))["fails-twice"]
    assert event["route"] == ["twice@a", "twice@b"]
    aborted = stack["fake"].aborts[aborts_before:]
    assert len(set(aborted)) == 2 and event["upstream_request_id"] == aborted[-1], "each failed hop is told to stop"
    assert (event["prompt_tokens"], event["completion_tokens"]) == (2 * len(PROMPT), 0), "both prefills billed"


async def stream_timeouts(client, model: str, n: int) -> list[str]:
    codes = []
    for _ in range(n):
        with pytest.raises(openai.APIStatusError) as exc:
            await client.completions.create(
                model=model, prompt=PROMPT, max_tokens=2, stream=True, extra_body={"fake": {"ttft_ms": 1500}}
            )
        codes.append(f"{exc.value.status_code} {exc.value.code}")
    return codes


async def test_pool_timeouts_open_the_circuit_but_a_teams_tighter_limit_does_not(stack):
    _, client = make_team(stack)
    codes = await stream_timeouts(client, "hangs", 4)
    assert codes == ["504 timeout"] * 3 + ["503 upstream_unavailable"], "a hung instance is routed around"
    _, impatient = make_team(stack, ttft_timeout_s=0.2)
    codes = await stream_timeouts(impatient, "hangs-for-a-team", 4)
    assert codes == ["504 timeout"] * 4, "the team's own limit fired: the shared instance is not to blame"
    async with httpx.AsyncClient(base_url=stack["url"], headers=stack["admin"]) as http:
        pools = (await http.get("/health")).json()["pools"]
    assert (pools["hangs"][0]["circuit"], pools["hangs-for-a-team"][0]["circuit"]) == ("open", "closed")
