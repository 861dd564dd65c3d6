"""What only a Redis Cluster asks of RedisState, against a real local cluster of 3 primaries and 3 replicas
(tests/support/redis_cluster.py): each team's calls run on the primary that serves its slot, a slot being migrated
(ASK) or moved (MOVED) is followed, a primary without the scripts gets them, the epoch marker is kept on every
primary so that one primary losing its data is a loss (its running holds are put back, and re-seeding refills only its
teams' spend), and a primary killed is an unavailable state until its replica takes over, with nothing taken twice or
left behind. The contract the backends share runs on the cluster too (test_state_backends.py, test_state_redis.py)."""

import asyncio
import itertools
import time
import uuid

import pytest

from tests.support.redis_cluster import slot_of
from tokenweir.gateway.state.backend import Lease, StateUnavailable
from tokenweir.gateway.state.redis import RedisState
from tokenweir.gateway.state.redis_epoch import RedisEpoch, SubjectSpend
from tokenweir.policies.decisions import Rejected
from tokenweir.policies.limits import TeamLimits


@pytest.fixture
async def on_cluster(redis_cluster):
    """A RedisState on a fresh prefix of the session's cluster (and the cluster)."""
    redis_cluster.wait_ok()
    state = RedisState(redis_cluster.url, prefix=f"twtest-{uuid.uuid4().hex[:12]}", cluster=True)
    yield state, redis_cluster
    await state.close()


def team_on(cluster, node) -> str:
    """A team id whose keys live on `node` (a primary)."""
    with cluster.admin(node) as admin:
        slots = admin.execute_command("CLUSTER SLOTS")
    ranges = [(first, last) for first, last, primary, *_ in slots if int(primary[1]) == node.client_port]
    return next(t for t in map("team-{}".format, itertools.count()) if any(a <= slot_of(t) <= b for a, b in ranges))


async def test_each_teams_calls_run_on_the_primary_that_serves_its_slot(on_cluster):
    state, cluster = on_cluster
    teams = [f"team-{i}" for i in range(12)]
    held = [await state.reserve(t, TeamLimits(tokens_per_day=1000), 10, 20) for t in teams]
    for res in held:
        await state.settle(res, 10, 5)
    seen = set()
    for team in teams:
        primary = cluster.primary_of(slot_of(team))
        seen.add(primary.index)
        with cluster.admin(primary) as admin:
            assert admin.exists(state.keys.key(team, "meta")), team
        snap = await state.snapshot(team)
        assert (snap["spent_today"], snap["reserved_tokens"], snap["open_reservations"]) == (15, 0, 0)
    assert len(seen) == 3  # the teams are spread over every primary


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "pooled"])
async def test_a_primary_without_the_scripts_gets_them_and_the_call_is_answered(on_cluster, lean):
    state, cluster = on_cluster
    assert state._connection.lines is not None
    state._connection.lines._lean = lean  # pooled: what a TLS cluster (rediss://) uses
    res = await state.reserve("t", TeamLimits(), 1, 1)
    for node in cluster.primaries():
        with cluster.admin(node) as admin:
            admin.script_flush()
    await state.settle(res, 1, 1)
    res = await state.reserve("t", TeamLimits(), 1, 1)
    await state.settle(res, 1, 1)
    assert (await state.snapshot("t"))["spent_today"] == 4


def migrate(cluster, slot: int, source, target, *, finish: bool) -> None:
    """Move `slot`'s keys from primary `source` to `target` (IMPORTING / MIGRATING, MIGRATE); with `finish`, hand the
    slot over (SETSLOT NODE) on every primary."""
    with cluster.admin(source) as src, cluster.admin(target) as dst:
        src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
        if keys:
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
    if finish:
        for node in cluster.primaries():
            with cluster.admin(node) as admin:
                admin.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)


async def test_a_slot_migrated_to_another_primary_is_followed_through_ask_then_moved(on_cluster):
    state, cluster = on_cluster
    limits = TeamLimits(tokens_per_day=100)
    source = cluster.primaries()[0]
    team = team_on(cluster, source)
    slot = slot_of(team)
    target = next(n for n in cluster.primaries() if n is not source)
    first = await state.reserve(team, limits, 10, 10)
    try:
        migrate(cluster, slot, source, target, finish=False)  # the keys moved, the slot not yet: ASK
        second = await state.reserve(team, limits, 10, 10)
        migrate(cluster, slot, source, target, finish=True)  # the slot moved: MOVED
        for res in (first, second):
            await state.settle(res, 10, 5)
        third = await state.reserve(team, limits, 10, 10)
        with pytest.raises(Rejected):  # 15 + 15 spent, 20 held: 50 of 100 left, 60 asked
            await state.reserve(team, limits, 50, 10)
        await state.settle(third, 10, 0)
        snap = await state.snapshot(team)
        assert (snap["spent_today"], snap["reserved_tokens"], snap["open_reservations"]) == (40, 0, 0)
    finally:
        owner = cluster.primary_of(slot)
        if owner is not source:
            migrate(cluster, slot, owner, source, finish=True)
        else:  # stopped half way: the slot stays where it was
            for node in (source, target):
                with cluster.admin(node) as admin:
                    admin.execute_command("CLUSTER SETSLOT", slot, "STABLE")


async def test_one_primary_losing_its_data_is_a_loss_and_a_reseed_refills_only_its_teams_and_holds(on_cluster):
    state, cluster = on_cluster
    epoch = RedisEpoch(state)
    await epoch.set("E1")
    assert await epoch.current() == "E1"
    lost, kept = cluster.primaries()[:2]
    lost_team, kept_team = team_on(cluster, lost), team_on(cluster, kept)
    spend = [SubjectSpend(None, day_tokens=100, month_tokens=100)]
    now = time.time()
    for team in (lost_team, kept_team):
        assert await epoch.seed_team(team, "E1", spend, now)
        res = await state.reserve(team, TeamLimits(), 5, 5)
        await state.settle(res, 5, 5)  # live spend 110: the store's 100 and 10 not flushed to the store yet
    lease = Lease("running", None, 5)
    running, got = await state.reserve_and_acquire(lost_team, TeamLimits(max_concurrency=5), 10, 30, lease=lease)
    assert got
    with cluster.admin(lost) as admin:
        admin.flushall()  # as a failover to a replica that had nothing
    assert await epoch.current() is None
    assert await epoch.restore(time.time()) == 1  # the running request's hold and lease, put back
    for team in (lost_team, kept_team):  # the rebuild: one seed per team, under a new epoch
        await epoch.seed_team(team, "E2", [SubjectSpend(None, day_tokens=110, month_tokens=110)], now)
    await epoch.set("E2")
    assert await epoch.current() == "E2"
    lost_snap = await state.snapshot(lost_team)
    assert (lost_snap["spent_today"], lost_snap["reserved_tokens"], lost_snap["in_flight"]) == (110, 40, 1)
    assert (await state.snapshot(kept_team))["spent_today"] == 110  # its live counters, not added to again
    await state.settle_and_release(running, 10, 20, lease=lease)
    lost_snap = await state.snapshot(lost_team)
    assert (lost_snap["spent_today"], lost_snap["reserved_tokens"], lost_snap["in_flight"]) == (140, 0, 0)


async def test_a_killed_primary_is_unavailable_until_its_replica_takes_over_and_nothing_is_left_behind(on_cluster):
    state, cluster = on_cluster
    limits = TeamLimits(tokens_per_day=10_000, max_concurrency=50)
    primary = cluster.primaries()[0]
    team = team_on(cluster, primary)
    for _ in range(5):
        lease = Lease(uuid.uuid4().hex, None, 50)
        res, got = await state.reserve_and_acquire(team, limits, 10, 10, lease=lease)
        assert got
        await state.settle_and_release(res, 10, 10, lease=lease)
    await asyncio.sleep(0.1)  # replicated (asynchronously) before the kill
    cluster.kill(primary)
    pending, outcomes = [], []
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            lease = Lease(uuid.uuid4().hex, None, 50)
            try:
                res, got = await state.reserve_and_acquire(team, limits, 10, 10, lease=lease)
            except StateUnavailable as e:  # never another error: the degraded mode answers 503 state_unavailable
                outcomes.append("unavailable")
                pending.append(e.pending)
                await asyncio.sleep(0.05)
                continue
            outcomes.append("served")
            await state.settle_and_release(res, 10, 10, lease=lease)
            if outcomes.count("served") >= 3:
                break
        assert "unavailable" in outcomes and outcomes[-3:] == ["served"] * 3, outcomes
        for op in pending:  # what the outbox replays: the undo of every reserve whose answer was lost
            await state.replay(op)
        snap = await state.snapshot(team)
        assert snap["spent_today"] == 20 * 8  # the 5 before the kill were replicated, the 3 after are there
        assert (snap["reserved_tokens"], snap["open_reservations"], snap["in_flight"]) == (0, 0, 0)
        await state.ping()
    finally:
        cluster.restart(primary)
