"""Redis losing its data mid-traffic (FLUSHDB: a failover to an empty replica, a restart without persistence) hands
out no budget twice and no concurrency slot twice: two gateway replicas on the real Redis and one SQLite store,
client -> gateway -> fake upstream over real HTTP. The replicas refuse the team (503 state_unavailable) until one of
them has re-seeded its spend from the store, and put back the leases of the requests still running first.

The database is Redis's db 13, flushed whole by these tests (no other test uses it).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import pytest
import redis

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.services import require_service
from tokenweir.gateway.accounting.usage import UsageRecorder
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, StateConfig, UpstreamConfig
from tokenweir.gateway.state.backend import StateUnavailable
from tokenweir.gateway.state.redis import RedisState
from tokenweir.gateway.state.redis_epoch import RedisEpoch, SubjectSpend
from tokenweir.gateway.state.repair import StateWatch
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import KeyLimits, TeamLimits

URL = "redis://127.0.0.1:6379/13"
PROMPT = [101, 102, 103, 104, 105, 106]  # 6 tokens, as the gateway and the fake upstream both count them
PER_REQUEST = len(PROMPT) + 20  # max_tokens 20, and the fake upstream makes all 20


@pytest.fixture
def replicas(tmp_path):
    client = redis.Redis.from_url(URL)
    try:
        client.flushdb()
    except redis.RedisError as err:
        require_service("redis", f"{URL}: {err}")
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    fake = FakeUpstream()
    prefix = f"twloss-{uuid.uuid4().hex[:8]}"
    with ServerThread(fake) as upstream:
        pool = PoolConfig(model="m", upstreams=[UpstreamConfig(upstream.url, engine=False)], capacity=64)
        pool.max_queued = 256

        def config(i: int) -> GatewayConfig:
            events = EventsConfig(path=str(tmp_path / f"events-{i}.jsonl"), flush_interval_s=0.05)
            state = StateConfig(watch_s=0.2)
            return GatewayConfig(port=0, pools=[pool], events=events, usage_flush_interval_s=0.2, state=state)

        states = [RedisState(URL, prefix=prefix, lease_s=3.0) for _ in range(2)]
        a, b = (serve_app(config(i), store=store, state_backend=states[i]) for i in range(2))
        with a, b:
            yield {"urls": [a.url, b.url], "store": store, "fake": fake, "redis": client}
    client.flushdb()
    client.close()
    store.close()


def body(**fake) -> dict:
    return {"model": "m", "prompt": PROMPT, "max_tokens": 20, "fake": {"tokens": 20, **fake}}


async def send(url: str, secret: str, payload: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        return await c.post("/v1/completions", json=payload, headers={"authorization": f"Bearer {secret}"})


def made_tokens(fake: FakeUpstream) -> int:
    prompt, completion = fake.totals()
    return prompt + completion


async def until_refused(urls: list[str], secret: str, deadline_s: float) -> list[int]:
    """Send one request at a time, alternating replicas, until a budget refusal (429) or the deadline."""
    statuses, deadline = [], time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        r = await send(urls[len(statuses) % 2], secret, body())
        statuses.append(r.status_code)
        if r.status_code == 429:
            return statuses
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "state_unavailable", r.text
            await asyncio.sleep(0.05)
    return statuses


async def test_a_key_budget_is_not_handed_out_again_after_redis_loses_its_data(replicas):
    store, fake = replicas["store"], replicas["fake"]
    team = store.create_team(f"team-{uuid.uuid4().hex[:8]}", TeamLimits(tokens_per_day=1_000_000))
    secret, _ = store.create_key(team.id, "k", limits=KeyLimits(tokens_per_day=1200))
    before = await until_refused(replicas["urls"], secret, deadline_s=60)
    assert before[-1] == 429 and before.count(200) == 1200 // PER_REQUEST, before
    served_before = made_tokens(fake)
    await asyncio.sleep(0.5)  # the usage of the last requests reaches the store (flushed every 0.2 s)

    replicas["redis"].flushdb()
    after = await until_refused(replicas["urls"], secret, deadline_s=20)
    assert after[-1] == 429, after  # refused again once re-seeded: the day's spend came back from the store
    assert after.count(200) == 0, after
    assert made_tokens(fake) == served_before <= 1200


async def test_concurrency_stays_bounded_across_a_loss_while_requests_run(replicas):
    store, fake = replicas["store"], replicas["fake"]
    team = store.create_team(f"team-{uuid.uuid4().hex[:8]}", TeamLimits(max_concurrency=3))
    secret, _ = store.create_key(team.id, "k")
    peak, sampling = [0], threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], fake.running())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    urls = replicas["urls"]
    slow = body(ttft_ms=4000)
    first = [asyncio.create_task(send(urls[i % 2], secret, slow)) for i in range(3)]
    while fake.running() < 3:
        await asyncio.sleep(0.01)
    replicas["redis"].flushdb()
    statuses: list[int] = []
    deadline = time.monotonic() + 3.0  # the repair takes ~1.2 s (watch_s 0.2): ask before, during and after it
    while time.monotonic() < deadline:
        r = await send(urls[len(statuses) % 2], secret, body(ttft_ms=2000))
        statuses.append(r.status_code)
        await asyncio.sleep(0.05)
    done = await asyncio.gather(*first)
    sampling.set()
    sampler.join()
    assert [r.status_code for r in done] == [200, 200, 200]
    assert peak[0] <= 3, (peak[0], statuses)
    assert 503 in statuses and 429 in statuses, statuses  # rebuilding, then at its cap with the leases put back


async def test_a_reserve_whose_answer_was_lost_is_undone_later():
    state = RedisState(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2, pool_timeout_s=0.2)  # nothing listens
    with pytest.raises(StateUnavailable) as lost:
        await state.reserve("t", TeamLimits(), 5, 10, key_id="k")
    undo = lost.value.pending
    assert undo is not None and (undo["op"], undo["tokens"], undo["cost"], undo["key_id"]) == ("settle", 0, 0, "k")
    await state.close()


async def test_holds_of_requests_running_across_a_loss_are_put_back_before_the_budget_is_reopened(replicas):
    store, fake, urls = replicas["store"], replicas["fake"], replicas["urls"]
    team = store.create_team(f"team-{uuid.uuid4().hex[:8]}", TeamLimits(tokens_per_day=300))
    secret, _ = store.create_key(team.id, "k")
    running = [asyncio.create_task(send(urls[i % 2], secret, body(ttft_ms=4000))) for i in range(10)]
    while fake.running() < 10:  # 10 x 26 = 260 of the 300 held
        await asyncio.sleep(0.01)
    replicas["redis"].flushdb()
    after = await until_refused(urls, secret, deadline_s=20)
    assert [r.status_code for r in await asyncio.gather(*running)] == [200] * 10
    assert after[-1] == 429 and after.count(200) == (300 - 260) // PER_REQUEST, after
    assert made_tokens(fake) == 11 * PER_REQUEST <= 300


async def test_a_seed_adds_the_stored_spend_exactly_and_once_per_epoch(redis_prefix):
    state = RedisState("redis://127.0.0.1:6379/0", prefix=redis_prefix)
    epoch = RedisEpoch(state)
    spend = [SubjectSpend(None, 10, 20, 1_500_000_000_123, 2 * 10**12), SubjectSpend("k1", 5, 6, 700, 800)]
    assert await epoch.seed_team("t1", "E1", spend, time.time())
    assert not await epoch.seed_team("t1", "E1", spend, time.time())  # a second replica's seed adds nothing
    team, key = await state.snapshot("t1"), await state.snapshot("t1", key_id="k1")
    assert (team["day"]["spent"], team["month"]["spent"], key["day"]["spent"]) == (10, 20, 5)
    assert (team["day_usd"]["spent"], key["day_usd"]["spent"]) == (0.001500000000123, 7e-13)
    await state.close()


async def test_replicas_starting_together_on_an_empty_redis_all_adopt_the_one_seeding(tmp_path, redis_prefix):
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    team = store.create_team(f"team-{uuid.uuid4().hex[:8]}", TeamLimits(tokens_per_day=1000))
    states = [RedisState("redis://127.0.0.1:6379/0", prefix=redis_prefix) for _ in range(3)]
    watches = [StateWatch(s, store, UsageRecorder(store)) for s in states]
    await asyncio.gather(*(w.start() for w in watches))  # one wins the seeding lock, the others wait for its epoch
    assert len({w.known for w in watches}) == 1 and watches[0].known is not None
    late = store.create_team(f"team-{uuid.uuid4().hex[:8]}", TeamLimits(tokens_per_day=1000))
    for i, t in enumerate((team, late, late)):  # a team seeded at start; a team created since, seeded on its arrival
        hold = await states[i].reserve(t.id, t.limits, 5, 10)
        await states[i].settle(hold, 5, 10)
    for s in states:
        await s.close()
    store.close()
