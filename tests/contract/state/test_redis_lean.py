"""The request's two scripts go lean (gateway.state.redis_wire: packed once, sent pipelined on a connection of their
own): against the real Redis, what redis-py's Script call did still holds. NOSCRIPT (SCRIPT FLUSH) loads the script
and calls again; a connection Redis closed while idle is not reused; one killed, cancelled or timed out mid-call ends
as StateUnavailable (its op pending) or CancelledError and no later reply is misread; many calls at once each get
their own reply; the connection is made with the URL's user, password, db and client name; the pool's other
callers are never starved, and its connections Redis closed are reconnected before use."""

import asyncio
import uuid

import pytest
import redis

from tests.support.state import NOW, URL
from tokenweir.gateway.state.backend import Lease, StateUnavailable
from tokenweir.gateway.state.redis import RedisState
from tokenweir.policies.limits import KeyLimits, TeamLimits

LIMITS = TeamLimits(rpm=1000, tpm=10**6, tokens_per_day=10**7, max_concurrency=50)


@pytest.fixture
def admin():
    client = redis.Redis.from_url(URL, decode_responses=True)
    yield client
    client.close()


async def request(state: RedisState, now: float = NOW, caps: bool = True) -> dict:
    """One request's two calls; the team's snapshot after."""
    lease = Lease(uuid.uuid4().hex, "k", max_concurrency=50, key_max=5) if caps else Lease(uuid.uuid4().hex)
    hold, took = await state.reserve_and_acquire(
        "t", LIMITS, 10, 20, now, key_id="k", key_limits=KeyLimits(), lease=lease
    )
    assert took
    await state.settle_and_release(hold, 10, 5, now + 1, lease=lease)
    return await state.snapshot("t", now + 1)


def own_clients(admin, name: str, command: str | None = None) -> list[dict]:
    return [c for c in admin.client_list() if c["name"] == name and (command is None or c["cmd"] == command)]


async def test_noscript_after_script_flush_loads_the_script_and_calls_again(redis_prefix, admin):
    state = RedisState(URL, prefix=redis_prefix)
    assert (await request(state))["spent_today"] == 15
    admin.script_flush()
    assert (await request(state, NOW + 2))["spent_today"] == 30
    assert admin.script_exists(state._reserve_script.sha, state._settle.sha) == [True, True]
    await state.close()


async def test_a_connection_redis_closed_while_idle_is_not_reused(redis_prefix, admin):
    name = f"lean-{uuid.uuid4().hex[:8]}"
    state = RedisState(f"{URL}?client_name={name}", prefix=redis_prefix)
    await request(state)
    for client in own_clients(admin, name, "evalsha"):  # the idle pooled one the scripts went through
        admin.client_kill_filter(_id=client["id"])
    await asyncio.sleep(0.05)
    assert (await request(state, NOW + 2))["spent_today"] == 30  # no error: a fresh connection was used
    await state.close()


async def paused_writes(admin, call):
    """Run `call` while Redis holds every write (scripts included) for a moment; returns its task once it waits."""
    admin.client_pause(2000, all=False)  # WRITE: EVALSHA waits, this admin client's reads do not
    task = asyncio.ensure_future(call)
    for _ in range(100):
        await asyncio.sleep(0.01)
        if task.done():
            break
    return task


@pytest.mark.parametrize("how", ["killed", "cancelled"])
async def test_a_call_cut_mid_way_ends_unavailable_and_the_connection_is_not_reused(redis_prefix, admin, how):
    name = f"lean-{uuid.uuid4().hex[:8]}"
    state = RedisState(f"{URL}?client_name={name}", prefix=redis_prefix)
    await request(state)  # a connection at hand
    lease = Lease(uuid.uuid4().hex)
    try:
        task = await paused_writes(admin, state.reserve_and_acquire("t", LIMITS, 10, 20, NOW + 2, lease=lease))
        for _ in range(100):  # until Redis shows it waiting
            if own_clients(admin, name, "evalsha"):
                break
            await asyncio.sleep(0.01)
        waiting = own_clients(admin, name, "evalsha")
        assert len(waiting) == 1 and not task.done()
        if how == "killed":
            admin.client_kill_filter(_id=waiting[0]["id"])
        else:
            task.cancel()
    finally:
        admin.client_unpause()
    if how == "killed":
        with pytest.raises(StateUnavailable) as err:
            await task
        assert err.value.pending["op"] == "settle" and err.value.pending["release"]["lease_id"] == lease.lease_id
        await state.replay(err.value.pending)  # the outbox's undo: the hold and lease given back
    else:
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)  # Redis ran the script once unpaused: its answer must never be read as the next one's
        snap = await state.snapshot("t", NOW + 2)
        assert snap["open_reservations"] == 1
    snap = await request(state, NOW + 3)
    # a cancelled caller's hold and lease were taken once Redis ran the script (its undo is the caller's job)
    assert snap["spent_today"] == 30 and snap["in_flight"] == (0 if how == "killed" else 1)
    await state.close()


async def test_the_lean_calls_share_the_pool_with_its_other_callers(redis_prefix):
    state = RedisState(URL, prefix=redis_prefix, max_connections=8, pool_timeout_s=5.0)

    async def hot(i: int) -> None:
        await request(state, NOW + i % 50, caps=False)

    async def other(i: int) -> None:
        await state.snapshot("t", NOW)
        await state.client.ping()

    await asyncio.gather(*(f(i) for i in range(100) for f in (hot, other)))
    await asyncio.wait_for(asyncio.gather(*(other(i) for i in range(20))), 5)
    assert (await state.snapshot("t", NOW + 60))["spent_today"] == 1500
    await state.close()


async def test_calls_at_once_share_one_connection_and_each_gets_its_own_reply(redis_prefix, admin):
    name = f"lean-{uuid.uuid4().hex[:8]}"
    state = RedisState(f"{URL}?client_name={name}", prefix=redis_prefix)
    teams = [f"t{i}" for i in range(40)]

    async def use(team: str, i: int) -> int:
        hold = await state.reserve(team, LIMITS, i, 0, NOW)  # a hold of i tokens: reserved_tokens tells replies apart
        return (await state.snapshot(team, NOW))["reserved_tokens"] - hold.tokens

    offsets = await asyncio.gather(*(use(team, i + 1) for i, team in enumerate(teams)))
    assert offsets == [0] * len(teams)
    assert len(own_clients(admin, name, "evalsha")) == 1  # one pipelined connection carried all 40
    await state.close()


async def test_a_reply_past_the_timeout_drops_the_connection_and_the_next_call_is_answered(redis_prefix, admin):
    state = RedisState(URL, prefix=redis_prefix, timeout_s=0.3)
    await request(state)
    lease = Lease(uuid.uuid4().hex)
    try:
        task = await paused_writes(admin, state.reserve_and_acquire("t", LIMITS, 10, 20, NOW + 2, lease=lease))
        with pytest.raises(StateUnavailable) as err:
            await task
    finally:
        admin.client_unpause()
    assert "TimeoutError" in str(err.value) and err.value.pending["release"]["lease_id"] == lease.lease_id
    await state.replay(err.value.pending)
    snap = await request(state, NOW + 3)
    assert snap["spent_today"] == 30 and snap["in_flight"] == 0 and snap["open_reservations"] == 0
    await state.close()


async def test_the_connection_is_made_with_the_urls_user_password_db_and_name(redis_prefix, admin):
    user, password, name = f"tw-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex, f"lean-{uuid.uuid4().hex[:8]}"
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"])
    db = redis.Redis.from_url("redis://127.0.0.1:6379/3", decode_responses=True)
    try:
        state = RedisState(f"redis://{user}:{password}@127.0.0.1:6379/3?client_name={name}", prefix=redis_prefix)
        assert (await request(state))["spent_today"] == 15
        (client,) = own_clients(admin, name, "evalsha")
        assert client["user"] == user and client["db"] == "3"
        assert db.keys(f"{redis_prefix}*") and not admin.keys(f"{redis_prefix}*")
        await state.close()
        wrong = RedisState(f"redis://{user}:not-{password}@127.0.0.1:6379/3", prefix=redis_prefix)
        with pytest.raises(StateUnavailable, match="AuthenticationError|WRONGPASS|invalid"):
            await wrong.reserve("t", LIMITS, 1, 1, NOW)
        await wrong.close()
    finally:
        for key in db.keys(f"{redis_prefix}*"):
            db.delete(key)
        db.close()
        admin.acl_deluser(user)


async def test_pooled_connections_redis_closed_are_reconnected_before_use(redis_prefix, admin):
    name = f"lean-{uuid.uuid4().hex[:8]}"
    state = RedisState(f"{URL}?client_name={name}", prefix=redis_prefix)
    await request(state)
    pooled = [c for c in own_clients(admin, name) if c["cmd"] != "evalsha"]
    assert pooled  # the snapshot's connection, back in the pool
    for client in pooled:
        admin.client_kill_filter(_id=client["id"])
    await asyncio.sleep(0.05)
    assert (await state.snapshot("t", NOW + 1))["spent_today"] == 15
    await state.close()


async def test_a_lost_connection_while_seeding_a_team_is_state_unavailable_not_an_error(redis_prefix):
    state = RedisState(URL, prefix=redis_prefix, require_seeded=True)

    async def seeding_fails(team_id: str) -> bool:
        raise redis.ConnectionError("Connection closed by server.")

    state.on_unseeded = seeding_fails
    with pytest.raises(StateUnavailable, match="seeding team t"):
        await state.reserve("t", LIMITS, 1, 1, NOW)
    await state.close()
