"""What only RedisState has, against a real Redis: a settle on another replica is a no-op, dead replicas' holds and
slots lapse, leases are renewed, seeding never overwrites live counters, and parity with InMemoryState (the Lua
scripts' window and budget arithmetic against the Python copy in policies.rate / policies.budget), each on the real
Redis and on a local Redis Cluster (`redis_at`). The contract both backends share is tested once, on both, in
test_state_backends.py."""

import asyncio
import copy
import random

import pytest

from tests.support.state import NOW, Clock
from tokenweir.gateway.state.backend import Lease, StateUnavailable
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.policies.decisions import Rejected
from tokenweir.policies.limits import KeyLimits, TeamLimits


@pytest.fixture
async def replicas(redis_at):
    clock = Clock()
    states = [redis_at(clock=clock) for _ in range(2)]
    yield states, clock
    for s in states:
        await s.close()


async def test_a_settle_on_another_replica_is_a_no_op(replicas):
    (a, b), _ = replicas
    limits = TeamLimits(tpm=1000, tokens_per_day=1000, tokens_per_month=5000)
    res = await a.reserve("t", limits, 100, 500, now=NOW)
    assert res.headers["x-ratelimit-remaining-tokens"] == "400"
    twin = copy.copy(res)  # the same hold as another replica would see it
    await a.settle(res, 100, 50, now=NOW + 1)
    await b.settle(twin, 100, 400, now=NOW + 1)  # already settled in Redis: changes nothing
    snap = await b.snapshot("t", now=NOW + 1)
    assert snap["tokens_last_minute"] == 150
    assert (snap["day"]["spent"], snap["day"]["reserved"], snap["remaining_day"]) == (150, 0, 850)
    assert (snap["reserved_tokens"], snap["open_reservations"], snap["remaining_month"]) == (0, 0, 4850)


async def test_a_dead_replicas_holds_are_reaped_after_the_lease(redis_at):
    dead = redis_at(lease_s=30)
    live = redis_at(lease_s=30)
    limits = TeamLimits(tokens_per_day=2000)
    slow = await dead.reserve("t", limits, 400, 1600, now=NOW)  # not settled within its lease
    with pytest.raises(Rejected):
        await live.reserve("t", limits, 1, 1, now=NOW + 10)
    assert await live.reserve("t", limits, 400, 600, now=NOW + 31)  # the dead hold lapsed and was given back
    assert (await live.snapshot("t", now=NOW + 31))["open_reservations"] == 1
    # the "dead" replica was only slow: its late settle still bills what was made, and gives back nothing twice
    twin = copy.copy(slow)
    await dead.settle(slow, 400, 300, now=NOW + 40)
    await live.settle(twin, 400, 300, now=NOW + 40)  # and a second settle is still a no-op
    snap = await live.snapshot("t", now=NOW + 40)
    assert (snap["spent_today"], snap["day"]["reserved"], snap["reserved_tokens"]) == (700, 1000, 1000)
    await dead.close()
    await live.close()


async def test_slots_are_shared_and_leases_lapse(redis_at):
    clock = Clock()
    a = redis_at(lease_s=30, clock=clock)
    b = redis_at(lease_s=30, clock=clock)
    assert [await a.acquire_slot("t", 3), await b.acquire_slot("t", 3), await a.acquire_slot("t", 3)] == [True] * 3
    assert not await b.acquire_slot("t", 3)
    assert (await a.snapshot("t"))["in_flight"] == 3
    await a.release_slot("t")
    assert await b.acquire_slot("t", 3)
    # a keeps renewing its lease; b "crashes" (never releases, never renews)
    clock.t += 20
    await a.renew_leases()
    clock.t += 15  # b's two leases are past expiry, a's renewed one is not
    assert (await a.snapshot("t"))["in_flight"] == 1
    assert await a.acquire_slot("t", 3) and await a.acquire_slot("t", 3)
    assert not await a.acquire_slot("t", 3)
    for _ in range(3):
        await a.release_slot("t")
    assert (await a.snapshot("t"))["in_flight"] == 0
    assert await a.acquire_slot("u", None)
    await a.release_slot("u")
    with pytest.raises(AssertionError):
        await a.release_slot("u")
    await a.close()
    await b.close()


async def test_seed_spend_never_overwrites_live_counters(replicas):
    (a, b), _ = replicas
    await a.seed_spend("t", day_tokens=900, month_tokens=9000, now=NOW)
    limits = TeamLimits(tokens_per_day=1000)
    res = await a.reserve("t", limits, 50, 50, now=NOW)
    await a.settle(res, 50, 50, now=NOW)
    await b.seed_spend("t", day_tokens=900, month_tokens=9000, now=NOW)  # a replica starting later, stale store
    snap = await b.snapshot("t", now=NOW)
    assert (snap["spent_today"], snap["spent_month"], snap["remaining_day"]) == (1000, 9100, 0)


@pytest.mark.parametrize("keyed", [False, True], ids=["team", "team+key"])
@pytest.mark.parametrize("seed", range(3))
async def test_parity_with_in_memory_state(redis_at, seed, keyed):
    """The window and budget arithmetic exists twice: in Lua (gateway/state/redis_lua.py, it runs inside Redis) and
    once in Python (policies.rate: SlidingWindow, slot_index, oldest_counted_slot, slot_leaves_window_s;
    policies.budget: Budget, period_bounds; views from policies.snapshot). Random traffic must get the same
    decisions, headers and counters from both, for a team alone and for a key with limits of its own under it
    (token and spend budgets). Half the reservations take a concurrency lease with them (reserve_and_acquire, given
    back by settle_and_release): the slot decisions must agree too."""
    rng = random.Random(seed)
    # holds and leases outlive the run: reaping a dead replica's is Redis's alone (tested above), not arithmetic
    redis_state, memory = redis_at(hold_s=3600, lease_s=3600), InMemoryState()
    limits = TeamLimits(rpm=40, tpm=3000, tokens_per_day=5000, tokens_per_month=8000, usd_per_month=0.6)
    # half the requests come with a key whose own limits are tighter in some dimensions: either may say no
    key_limits = KeyLimits(rpm=10, tpm=2500, tokens_per_day=2000, usd_per_day=0.15)
    held = []
    now = NOW
    for _ in range(120):
        now += rng.random() * 2
        if held and rng.random() < 0.4:
            r1, r2, lease = held.pop(rng.randrange(len(held)))
            prompt, completion = rng.randint(0, 50), rng.randint(0, 200)
            cost = rng.randint(0, 30_000 * 10**9)  # exact femto-USD: its part below a micro-dollar carries too
            await redis_state.settle_and_release(r1, prompt, completion, now=now, cost=cost, lease=lease)
            await memory.settle_and_release(r2, prompt, completion, now=now, cost=cost, lease=lease)
            continue
        prompt, max_tokens, cost = rng.randint(1, 80), rng.randint(1, 200), rng.randint(0, 20_000)
        key = {"key_id": "k", "key_limits": key_limits} if keyed and rng.random() < 0.5 else {}
        # the key's own slot (at most 2) where the request comes with the key, the team's (at most 4) always
        lease = Lease(f"lease-{len(held)}-{now!r}", key.get("key_id"), 4, 2) if rng.random() < 0.5 else None
        outcomes = []
        for state in (redis_state, memory):
            try:
                call = {"now": now, "cost": cost, **key}
                if lease is None:
                    outcomes.append((await state.reserve("t", limits, prompt, max_tokens, **call), False))
                else:
                    outcomes.append(
                        await state.reserve_and_acquire("t", limits, prompt, max_tokens, lease=lease, **call)
                    )
            except Rejected as err:
                outcomes.append((err, False))
        (r1, got1), (r2, got2) = outcomes
        assert type(r1) is type(r2) and got1 == got2
        if isinstance(r1, Rejected):
            assert (r1.reason, r1.retry_after_s, r1.message) == (r2.reason, r2.retry_after_s, r2.message)
        else:
            assert r1.headers == r2.headers
            held.append((r1, r2, lease if got1 else None))
    for key_id in ("k", None) if keyed else (None,):
        a = await redis_state.snapshot("t", now=now, key_id=key_id)
        b = await memory.snapshot("t", now=now, key_id=key_id)
        for name in ("reserved_tokens", "open_reservations", "requests_last_minute", "tokens_last_minute", "in_flight"):
            assert a[name] == b[name], name
        for name in ("spent", "reserved", "remaining", "overshoot"):
            for period in ("day", "month", "day_usd", "month_usd"):
                assert a[period][name] == b[period][name], (key_id, period, name)
    await redis_state.close()


async def test_a_reserve_and_acquire_whose_answer_was_lost_is_undone_with_its_lease(replicas, redis_at):
    (a, b), _ = replicas
    gone = redis_at.unreachable(timeout_s=0.2, pool_timeout_s=0.2)
    with pytest.raises(StateUnavailable) as lost:
        await gone.reserve_and_acquire("t", TeamLimits(), 5, 10, key_id="k", lease=Lease("L0", "k", 1, 1))
    release = {"op": "release_slot", "team_id": "t", "lease_id": "L0", "key_id": "k"}
    assert lost.value.pending is not None and lost.value.pending["release"] == release
    await gone.close()
    # what the outbox then replays gives back both, wherever the answer was lost
    limits = TeamLimits(tokens_per_day=100, max_concurrency=1)
    res, got = await a.reserve_and_acquire("t", limits, 5, 10, now=NOW, key_id="k", lease=Lease("L1", "k", 1, 1))
    assert got
    undo = {"op": "settle", "team_id": "t", "res_id": res.backend_id, "tokens": 0, "now": NOW, "key_id": "k"}
    await b.replay(undo | {"cost": 0, "release": Lease("L1", "k").release_op("t")})
    snaps = [await b.snapshot("t", now=NOW), await b.snapshot("t", now=NOW, key_id="k")]
    assert [(s["in_flight"], s["open_reservations"], s["reserved_tokens"]) for s in snaps] == [(0, 0, 0)] * 2


async def test_a_lease_taken_with_its_reservation_is_renewed_until_settled(redis_at):
    state = redis_at(lease_s=0.15)  # real clock; renewed every 50 ms
    other = redis_at(lease_s=0.15)
    limits = TeamLimits(max_concurrency=1)
    res, got = await state.reserve_and_acquire("t", limits, 1, 1, lease=Lease("L", None, 1))
    assert got
    await asyncio.sleep(0.35)  # over two leases later the slot is still held: no one else gets it
    assert not await other.acquire_slot("t", 1)
    await state.settle_and_release(res, 1, 1, lease=Lease("L"))
    assert state.leases == {}
    assert await other.acquire_slot("t", 1)
    await other.release_slot("t")
    await state.close()
    await other.close()


async def test_background_renewal_keeps_live_leases_past_their_first_expiry(redis_at):
    state = redis_at(lease_s=0.15)  # real clock; renewed every 50 ms
    other = redis_at(lease_s=0.15)
    assert await state.acquire_slot("t", 1)
    await asyncio.sleep(0.35)  # over two leases later the slot is still held: no one else gets it
    assert not await other.acquire_slot("t", 1)
    await state.release_slot("t")
    assert await other.acquire_slot("t", 1)
    await other.release_slot("t")
    await state.close()
    await other.close()
