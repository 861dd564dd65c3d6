"""Pool members' max_parallel_requests counted across replicas (gateway/state/member_slots.py): two RedisStates on one
prefix of the real Redis, or of a Redis Cluster, are two gateway replicas; without Redis one process counts alone."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.state import Clock
from tokenweir.gateway.state.member_slots import LOCAL, MemberSlots
from tokenweir.gateway.state.memory import InMemoryState

MEMBER = "http://10.0.0.7:8100"


@pytest.fixture
async def replicas(redis_at):
    clock = Clock()
    states = [redis_at(clock=clock) for _ in range(2)]
    slots = [MemberSlots(s, lease_s=5.0, clock=clock) for s in states]
    yield slots, clock
    for s in slots:
        await s.close()
    for st in states:
        await st.close()


async def test_two_replicas_never_hold_more_than_the_members_limit(replicas):
    (a, b), _ = replicas
    assert a.shared and b.shared
    first, second = await a.take(MEMBER, 2), await b.take(MEMBER, 2)
    assert first and second
    assert await a.take(MEMBER, 2) is None and await b.take(MEMBER, 2) is None
    assert await a.in_use(MEMBER) == 2
    assert await b.take("http://10.0.0.8:8100", 2) is not None  # another member counts alone
    await a.give_back(MEMBER, first)
    third = await b.take(MEMBER, 2)
    assert third is not None and await a.take(MEMBER, 2) is None
    await b.give_back(MEMBER, second)
    await b.give_back(MEMBER, third)
    assert await a.in_use(MEMBER) == 0 and b.held == {"http://10.0.0.8:8100": 1}


async def test_a_dead_replicas_leases_lapse_and_live_ones_are_renewed(replicas):
    (a, b), clock = replicas
    assert await a.take(MEMBER, 1) is not None
    clock.t += 4.0
    await a._book.renew()  # the live replica's renewal (its background task does this every lease_s / 3)
    clock.t += 4.0  # past the first expiry: renewed, still held
    assert await b.take(MEMBER, 1) is None
    a._book.leases.clear()  # the replica dies: nobody renews its lease
    clock.t += 5.1
    assert await b.take(MEMBER, 1) is not None


async def test_concurrent_takes_from_two_replicas_grant_exactly_the_limit(replicas):
    (a, b), _ = replicas
    leases = await asyncio.gather(*(s.take(MEMBER, 3) for s in (a, b) * 10))
    assert sum(lease is not None for lease in leases) == 3
    assert await a.in_use(MEMBER) == 3


async def test_redis_away_leaves_each_replica_its_own_count(redis_at):
    state = redis_at.unreachable(timeout_s=0.2, pool_timeout_s=0.2)
    slots = MemberSlots(state)
    try:
        leases = [await slots.take(MEMBER, 2) for _ in range(3)]
        assert [lease is not None and lease.startswith(LOCAL) for lease in leases] == [True, True, False]
        await slots.give_back(MEMBER, leases[0])
        assert await slots.take(MEMBER, 2) is not None
    finally:
        await slots.close()
        await state.close()


async def test_one_process_without_redis_counts_alone():
    slots = MemberSlots(InMemoryState())
    assert not slots.shared
    leases = [await slots.take(MEMBER, 2) for _ in range(3)]
    assert leases[2] is None
    await slots.give_back(MEMBER, leases[0])
    assert await slots.in_use(MEMBER) == 1
