"""RedisState against a real Redis: replicas share one set of limits; parity with InMemoryState; dead replicas'
holds and slots lapse."""

import asyncio
import copy
import random
import uuid
from datetime import UTC, datetime

import pytest

from gateway.state import InMemoryState
from gateway.state_redis import RedisState
from policies.decisions import Rejected
from policies.limits import TeamLimits
from tests.conftest import require_service

URL = "redis://127.0.0.1:6379/0"
NOW = datetime(2026, 5, 10, 12, 0, tzinfo=UTC).timestamp()


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def prefix():
    import redis

    client = redis.Redis.from_url(URL)
    try:
        client.ping()
    except redis.RedisError as err:
        require_service("redis", f"{URL}: {err}")
    name = f"twtest-{uuid.uuid4().hex[:12]}"
    yield name
    keys = list(client.scan_iter(f"{name}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
async def replicas(prefix):
    clock = Clock()
    states = [RedisState(URL, prefix=prefix, clock=clock) for _ in range(2)]
    yield states, clock
    for s in states:
        await s.close()


async def reserve_all(states, limits, n, prompt=40, max_tokens=60, now=NOW):
    async def one(i):
        try:
            return await states[i % len(states)].reserve("t", limits, prompt, max_tokens, now=now)
        except Rejected as err:
            return err

    results = await asyncio.gather(*[one(i) for i in range(n)])
    return [r for r in results if not isinstance(r, Rejected)], [r for r in results if isinstance(r, Rejected)]


@pytest.mark.parametrize(
    ("limits", "admits", "reason"),
    [
        (TeamLimits(tokens_per_day=1000), 10, "budget_exhausted"),
        (TeamLimits(rpm=37), 37, "rate_limited"),
        (TeamLimits(tpm=4321), 43, "rate_limited"),
        (TeamLimits(rpm=50, tpm=10_000, tokens_per_month=3000), 30, "budget_exhausted"),
    ],
)
async def test_two_replicas_200_concurrent_reserves_admit_exactly_what_fits(replicas, limits, admits, reason):
    states, _ = replicas
    admitted, rejected = await reserve_all(states, limits, 200)
    assert len(admitted) == admits
    assert {r.reason for r in rejected} == {reason}
    snap = states[1].snapshot("t", now=NOW)
    assert (snap["reserved_tokens"], snap["open_reservations"]) == (admits * 100, admits)


async def test_settle_refunds_and_is_idempotent_across_replicas(replicas):
    (a, b), _ = replicas
    limits = TeamLimits(tpm=1000, tokens_per_day=1000, tokens_per_month=5000)
    res = await a.reserve("t", limits, 100, 500, now=NOW)
    assert res.headers["x-ratelimit-remaining-tokens"] == "400"
    twin = copy.copy(res)  # the same hold as another replica would see it
    await a.settle(res, 100, 50, now=NOW + 1)
    await b.settle(twin, 100, 400, now=NOW + 1)  # already settled in Redis: changes nothing
    snap = b.snapshot("t", now=NOW + 1)
    assert snap["tokens_last_minute"] == 150
    assert (snap["day"]["spent"], snap["day"]["reserved"], snap["remaining_day"]) == (150, 0, 850)
    assert (snap["reserved_tokens"], snap["open_reservations"], snap["remaining_month"]) == (0, 0, 4850)


async def test_overshoot_is_charged(replicas):
    (a, _), _ = replicas
    res = await a.reserve("t", TeamLimits(tpm=1000, tokens_per_day=1000), 10, 90, now=NOW)
    await a.settle(res, 10, 140, now=NOW)
    snap = a.snapshot("t", now=NOW)
    assert (snap["spent_today"], snap["day"]["overshoot"], snap["tokens_last_minute"]) == (150, 50, 150)
    assert res.overshoot == 50


async def test_rate_rejection_headers_and_retry_after(replicas):
    (a, b), _ = replicas
    limits = TeamLimits(rpm=2, tpm=1000)
    await a.reserve("t", limits, 1, 1, now=NOW)
    await b.reserve("t", limits, 1, 1, now=NOW + 10)
    with pytest.raises(Rejected) as info:
        await a.reserve("t", limits, 1, 1, now=NOW + 20)
    err = info.value
    assert (err.reason, err.retry_after_s) == ("rate_limited", 41)
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert err.headers["x-ratelimit-remaining-tokens"] == "996"
    assert await b.reserve("t", limits, 1, 1, now=NOW + 61)


async def test_too_large_for_tpm_and_for_the_budget(replicas):
    (a, _), _ = replicas
    with pytest.raises(Rejected, match="too large"):
        await a.reserve("t", TeamLimits(tpm=100), 60, 60, now=NOW)
    with pytest.raises(Rejected, match="whole budget is 500"):
        await a.reserve("t", TeamLimits(tokens_per_month=500), 100, 401, now=NOW)
    snap = a.snapshot("t", now=NOW)
    assert (snap["requests_last_minute"], snap["reserved_tokens"]) == (0, 0)


async def test_day_rollover_and_settle_across_midnight(replicas):
    (a, _), _ = replicas
    limits = TeamLimits(tokens_per_day=100)
    late = datetime(2026, 5, 10, 23, 0, tzinfo=UTC).timestamp()
    res = await a.reserve("t", limits, 50, 50, now=late)
    with pytest.raises(Rejected) as info:
        await a.reserve("t", limits, 1, 1, now=late)
    assert (info.value.reason, info.value.retry_after_s) == ("budget_exhausted", 3600)
    midnight = late + 3600
    await a.settle(res, 50, 10, now=midnight)  # yesterday's hold settles onto today, as usage rows do
    snap = a.snapshot("t", now=midnight)
    assert (snap["day"]["period"], snap["spent_today"], snap["day"]["reserved"], snap["remaining_day"]) == (
        "2026-05-11",
        60,
        0,
        40,
    )


async def test_a_dead_replicas_holds_are_reaped_after_the_lease(prefix):
    dead = RedisState(URL, prefix=prefix, lease_s=30)
    live = RedisState(URL, prefix=prefix, lease_s=30)
    limits = TeamLimits(tokens_per_day=2000)
    slow = await dead.reserve("t", limits, 400, 1600, now=NOW)  # not settled within its lease
    with pytest.raises(Rejected):
        await live.reserve("t", limits, 1, 1, now=NOW + 10)
    assert await live.reserve("t", limits, 400, 600, now=NOW + 31)  # the dead hold lapsed and was given back
    assert live.snapshot("t", now=NOW + 31)["open_reservations"] == 1
    # the "dead" replica was only slow: its late settle still bills what was made, and gives back nothing twice
    twin = copy.copy(slow)
    await dead.settle(slow, 400, 300, now=NOW + 40)
    await live.settle(twin, 400, 300, now=NOW + 40)  # and a second settle is still a no-op
    snap = live.snapshot("t", now=NOW + 40)
    assert (snap["spent_today"], snap["day"]["reserved"], snap["reserved_tokens"]) == (700, 1000, 1000)
    await dead.close()
    await live.close()


async def test_slots_are_shared_and_leases_lapse(prefix):
    clock = Clock()
    a = RedisState(URL, prefix=prefix, lease_s=30, clock=clock)
    b = RedisState(URL, prefix=prefix, lease_s=30, clock=clock)
    assert [await a.acquire_slot("t", 3), await b.acquire_slot("t", 3), await a.acquire_slot("t", 3)] == [True] * 3
    assert not await b.acquire_slot("t", 3)
    assert a.snapshot("t")["in_flight"] == 3
    await a.release_slot("t")
    assert await b.acquire_slot("t", 3)
    # a keeps renewing its lease; b "crashes" (never releases, never renews)
    clock.t += 20
    await a.renew_leases()
    clock.t += 15  # b's two leases are past expiry, a's renewed one is not
    assert a.snapshot("t")["in_flight"] == 1
    assert await a.acquire_slot("t", 3) and await a.acquire_slot("t", 3)
    assert not await a.acquire_slot("t", 3)
    for _ in range(3):
        await a.release_slot("t")
    assert a.snapshot("t")["in_flight"] == 0
    assert await a.acquire_slot("u", None)
    await a.release_slot("u")
    with pytest.raises(AssertionError):
        await a.release_slot("u")
    await a.close()
    await b.close()


async def test_seed_spend_never_overwrites_live_counters(replicas):
    (a, b), _ = replicas
    a.seed_spend("t", day_tokens=900, month_tokens=9000, now=NOW)
    limits = TeamLimits(tokens_per_day=1000)
    res = await a.reserve("t", limits, 50, 50, now=NOW)
    await a.settle(res, 50, 50, now=NOW)
    b.seed_spend("t", day_tokens=900, month_tokens=9000, now=NOW)  # a replica starting later, stale store
    snap = b.snapshot("t", now=NOW)
    assert (snap["spent_today"], snap["spent_month"], snap["remaining_day"]) == (1000, 9100, 0)


@pytest.mark.parametrize("seed", range(3))
async def test_parity_with_in_memory_state(prefix, seed):
    rng = random.Random(seed)
    redis_state, memory = RedisState(URL, prefix=prefix), InMemoryState()
    limits = TeamLimits(rpm=40, tpm=3000, tokens_per_day=5000, tokens_per_month=8000)
    held = []
    now = NOW
    for _ in range(120):
        now += rng.random() * 2
        if held and rng.random() < 0.4:
            r1, r2 = held.pop(rng.randrange(len(held)))
            prompt, completion = rng.randint(0, 50), rng.randint(0, 200)
            await redis_state.settle(r1, prompt, completion, now=now)
            await memory.settle(r2, prompt, completion, now=now)
            continue
        prompt, max_tokens = rng.randint(1, 80), rng.randint(1, 200)
        outcomes = []
        for state in (redis_state, memory):
            try:
                outcomes.append(await state.reserve("t", limits, prompt, max_tokens, now=now))
            except Rejected as err:
                outcomes.append(err)
        r1, r2 = outcomes
        assert type(r1) is type(r2)
        if isinstance(r1, Rejected):
            assert (r1.reason, r1.retry_after_s, r1.message) == (r2.reason, r2.retry_after_s, r2.message)
        else:
            assert r1.headers == r2.headers
            held.append((r1, r2))
    a, b = redis_state.snapshot("t", now=now), memory.snapshot("t", now=now)
    for key in ("reserved_tokens", "open_reservations", "requests_last_minute", "tokens_last_minute"):
        assert a[key] == b[key], key
    for key in ("spent", "reserved", "remaining", "overshoot"):
        assert a["day"][key] == b["day"][key] and a["month"][key] == b["month"][key], key
    await redis_state.close()


async def test_background_renewal_keeps_live_leases_past_their_first_expiry(prefix):
    state = RedisState(URL, prefix=prefix, lease_s=0.15)  # real clock; renewed every 50 ms
    other = RedisState(URL, prefix=prefix, lease_s=0.15)
    assert await state.acquire_slot("t", 1)
    await asyncio.sleep(0.35)  # over two leases later the slot is still held: no one else gets it
    assert not await other.acquire_slot("t", 1)
    await state.release_slot("t")
    assert await other.acquire_slot("t", 1)
    await other.release_slot("t")
    await state.close()
    await other.close()
