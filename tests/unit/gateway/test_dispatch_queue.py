"""DispatchQueue: strict bands, weighted fairness, bounds, deadlines and cancellation safety, on real asyncio."""

import asyncio
import random
import time
from collections import Counter

import pytest

from tokenweir.gateway.request.queue import DispatchQueue
from tokenweir.policies.decisions import Rejected


async def settle_loop(rounds: int = 3) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def assert_drained(q: DispatchQueue) -> None:
    s = q.stats()
    assert (s["in_use"], s["queued"], s["queued_by_team"], s["in_use_by_team"]) == (0, 0, {}, {})
    assert all(n == 0 for n in s["queued_by_priority"].values())


async def drain_in_order(q: DispatchQueue, waiters: list[tuple[str, int, int]], blocker) -> list[tuple[str, int]]:
    """Queue every (team, priority, weight) behind `blocker`, then serve one at a time; returns dispatch order."""
    order = []

    async def waiter(team, priority, weight):
        ticket = await q.acquire(team, priority, weight, timeout_s=30)
        order.append((team, priority))
        await asyncio.sleep(0)
        q.release(ticket)

    tasks = [asyncio.create_task(waiter(*w)) for w in waiters]
    await settle_loop()
    assert q.stats()["queued"] == len(waiters)
    q.release(blocker)
    await asyncio.gather(*tasks)
    return order


async def test_free_slot_is_granted_at_once():
    q = DispatchQueue(capacity=2, max_queued=0)
    a = await q.acquire("t", 1)
    b = await q.acquire("t", 1)
    assert q.stats()["in_use"] == 2 and q.stats()["in_use_by_team"] == {"t": 2}
    assert a.queue_s < 0.05 and b.queue_s < 0.05 and a.id != b.id, "a free slot is granted without waiting"
    q.release(a)
    q.release(a)  # idempotent
    q.release(b)
    assert_drained(q)


async def test_higher_band_always_dispatches_first_under_saturation():
    q = DispatchQueue(capacity=1, max_queued=1000)
    blocker = await q.acquire("x", 1)
    rng = random.Random(1)
    waiters = [(rng.choice("abc"), rng.choice([0, 1, 2]), rng.randint(1, 4)) for _ in range(150)]
    order = await drain_in_order(q, waiters, blocker)
    priorities = [p for _, p in order]
    assert priorities == sorted(priorities)
    assert Counter(priorities) == Counter(p for _, p, _ in waiters)
    assert_drained(q)


async def test_late_critical_request_jumps_queued_batch_work():
    q = DispatchQueue(capacity=1, max_queued=100)
    order = []

    async def waiter(name, priority):
        ticket = await q.acquire(name, priority, timeout_s=5)
        order.append(name)
        await asyncio.sleep(0.001)
        q.release(ticket)

    blocker = await q.acquire("x", 1)
    batch = [asyncio.create_task(waiter(f"batch{i}", 2)) for i in range(5)]
    await settle_loop()
    q.release(blocker)
    await asyncio.sleep(0)  # batch0 holds the slot now
    critical = asyncio.create_task(waiter("critical", 0))
    await asyncio.gather(*batch, critical)
    assert order[0] == "batch0" and order[1] == "critical"
    assert_drained(q)


@pytest.mark.parametrize("weights", [(1, 3), (2, 1)])
async def test_weighted_shares_within_a_band(weights):
    q = DispatchQueue(capacity=1, max_queued=2000)
    blocker = await q.acquire("x", 1)
    per_team = 400
    waiters = [("a", 1, weights[0])] * per_team + [("b", 1, weights[1])] * per_team
    order = await drain_in_order(q, waiters, blocker)
    # while both teams still wait (the first 400 dispatches), shares follow the weights
    head = Counter(team for team, _ in order[:per_team])
    expected_a = per_team * weights[0] / sum(weights)
    assert abs(head["a"] - expected_a) <= 0.1 * expected_a
    assert abs(head["b"] - (per_team - expected_a)) <= 0.1 * (per_team - expected_a)
    assert_drained(q)


async def test_fifo_inside_a_team():
    q = DispatchQueue(capacity=1, max_queued=100)
    blocker = await q.acquire("x", 1)
    order = []

    async def waiter(i):
        ticket = await q.acquire("t", 1)
        order.append(i)
        q.release(ticket)

    tasks = []
    for i in range(20):
        tasks.append(asyncio.create_task(waiter(i)))
        await asyncio.sleep(0)
    q.release(blocker)
    await asyncio.gather(*tasks)
    assert order == list(range(20))


async def test_new_team_cannot_bank_credit():
    q = DispatchQueue(capacity=1, max_queued=1000)
    blocker = await q.acquire("x", 1)
    order = []

    async def waiter(team):
        ticket = await q.acquire(team, 1, 1, timeout_s=10)
        order.append(team)
        await asyncio.sleep(0)
        q.release(ticket)

    old = [asyncio.create_task(waiter("old")) for _ in range(100)]
    await settle_loop()
    q.release(blocker)
    while len(order) < 60:
        await asyncio.sleep(0)
    new = [asyncio.create_task(waiter("new")) for _ in range(40)]
    await asyncio.gather(*old, *new)
    after_join = order[order.index("new") - 1 :][:40]
    assert 15 <= Counter(after_join)["old"] <= 25  # alternating, not 40 "new" in a row


async def test_queue_bound_rejects_at_once():
    q = DispatchQueue(capacity=1, max_queued=3)
    blocker = await q.acquire("x", 1)
    waiting = [asyncio.create_task(q.acquire("t", 1)) for _ in range(3)]
    await settle_loop()
    with pytest.raises(Rejected) as info:
        await q.acquire("t", 1, timeout_s=10)
    err = info.value
    assert (err.reason, err.status) == ("queue_full", 429)
    assert err.retry_after_s >= 1 and err.headers["retry-after"] == str(err.retry_after_s)
    assert q.stats()["rejected_full"] == 1
    q.release(blocker)
    for waiter in waiting:  # capacity 1: each gets the slot once the one before gives it back
        q.release(await asyncio.wait_for(waiter, 1))
    assert_drained(q)


async def test_deadline_gives_queue_timeout_and_leaves_no_trace():
    q = DispatchQueue(capacity=1, max_queued=10)
    blocker = await q.acquire("x", 1)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(Rejected) as info:
        await q.acquire("t", 1, timeout_s=0.02)
    assert loop.time() - start >= 0.015
    assert (info.value.reason, info.value.status) == ("queue_timeout", 503)
    assert info.value.retry_after_s >= 1
    s = q.stats()
    assert (s["queued"], s["queued_by_team"], s["timed_out"]) == (0, {}, 1)
    q.release(blocker)
    assert_drained(q)


async def test_slot_granted_in_the_instant_of_cancellation_is_passed_on():
    q = DispatchQueue(capacity=1, max_queued=10)
    blocker = await q.acquire("x", 1)
    first = asyncio.create_task(q.acquire("a", 1))
    second = asyncio.create_task(q.acquire("b", 1))
    await settle_loop()
    q.release(blocker)  # hands the slot to `first` (its future resolved) ...
    first.cancel()  # ... which is cancelled before it ever runs again
    with pytest.raises(asyncio.CancelledError):
        await first
    ticket = await asyncio.wait_for(second, 1)  # the slot was passed on, not leaked
    assert ticket.team_id == "b"
    assert q.stats()["in_use"] == 1
    q.release(ticket)
    assert_drained(q)


async def test_cancelled_waiter_is_removed_from_the_queue():
    q = DispatchQueue(capacity=1, max_queued=10)
    blocker = await q.acquire("x", 1)
    waiter = asyncio.create_task(q.acquire("a", 1))
    await settle_loop()
    assert q.stats()["queued_by_team"] == {"a": 1}
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert q.stats()["queued"] == 0 and q.stats()["cancelled"] == 1
    q.release(blocker)
    assert_drained(q)


async def test_storm_of_cancellations_and_timeouts_leaves_nothing_behind():
    rng = random.Random(7)
    q = DispatchQueue(capacity=3, max_queued=120)
    outcomes = Counter()

    async def request(i):
        team, priority = rng.choice("abcd"), rng.choice([0, 1, 2])
        try:
            ticket = await q.acquire(team, priority, rng.randint(1, 3), timeout_s=rng.choice([0.005, 0.02, 1.0]))
        except Rejected as err:
            outcomes[err.reason] += 1
            return
        try:
            outcomes["dispatched"] += 1
            await asyncio.sleep(rng.choice([0, 0, 0.001, 0.003]))
        finally:
            q.release(ticket)  # hands the slot to a waiter, which may be cancelled in this same instant:
            waiting = [t for t in tasks if not t.done() and t is not asyncio.current_task()]
            if waiting and rng.random() < 0.3:
                waiting[0].cancel()  # the oldest waiter: often the very one just handed the slot

    tasks = []
    for i in range(400):
        tasks.append(asyncio.create_task(request(i)))
        if i % 10 == 0:
            await asyncio.sleep(0)
        if i % 7 == 0:
            rng.choice(tasks).cancel()
        if i % 50 == 0:
            q.set_capacity(rng.randint(1, 4))
    await asyncio.sleep(0.005)
    for task in rng.sample(tasks, 60):
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    outcomes["cancelled"] = sum(isinstance(r, asyncio.CancelledError) for r in results)
    assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)
    assert outcomes["dispatched"] > 0 and outcomes["cancelled"] > 0
    assert outcomes["queue_timeout"] + outcomes["queue_full"] > 0
    assert_drained(q)


async def test_growing_capacity_wakes_waiters_and_shrinking_drains():
    q = DispatchQueue(capacity=1, max_queued=10)
    held = [await q.acquire("t", 1)]
    waiting = [asyncio.create_task(q.acquire("t", 1)) for _ in range(3)]
    await settle_loop()
    q.set_capacity(3)
    await settle_loop()
    assert q.stats()["in_use"] == 3 and q.stats()["queued"] == 1
    held += [w.result() for w in waiting if w.done()]
    q.set_capacity(1)
    for ticket in held:
        q.release(ticket)  # in use drops to 0, then the last waiter gets the single slot
    last = await asyncio.wait_for(waiting[-1], 1)
    assert q.stats()["in_use"] == 1
    q.release(last)
    assert_drained(q)


async def test_zero_capacity_queues_everything():
    q = DispatchQueue(capacity=0, max_queued=5)
    with pytest.raises(Rejected) as info:
        await q.acquire("t", 1, timeout_s=0.01)
    assert info.value.reason == "queue_timeout"
    assert_drained(q)


async def test_out_of_range_priorities_fall_into_the_edge_bands():
    q = DispatchQueue(capacity=1, max_queued=10)
    blocker = await q.acquire("x", 1)
    low = asyncio.create_task(q.acquire("a", 10**9))
    high = asyncio.create_task(q.acquire("b", -7))
    await settle_loop()
    assert q.stats()["queued_by_priority"] == {0: 1, 2: 1}
    q.release(blocker)
    first = await asyncio.wait_for(high, 1)
    assert first.priority == 0
    q.release(first)
    q.release(await asyncio.wait_for(low, 1))
    assert_drained(q)


async def fill(q: DispatchQueue, waiters: list[tuple[str, int]]) -> list[asyncio.Task]:
    """Queue each (team, priority) in order, one event-loop turn apart, so arrival order is the list's order."""
    tasks = []
    for team, priority in waiters:
        tasks.append(asyncio.create_task(q.acquire(team, priority, timeout_s=30)))
        await settle_loop()
    return tasks


async def test_full_queue_sheds_the_latest_lowest_band_waiter_for_a_higher_band():
    q = DispatchQueue(capacity=2, max_queued=4)
    running = [await q.acquire("batch", 2), await q.acquire("batch", 2)]
    queued = await fill(q, [("batch", 2), ("std", 1), ("batch", 2), ("std", 1)])
    critical = asyncio.create_task(q.acquire("crit", 0, timeout_s=30))
    await settle_loop()
    with pytest.raises(Rejected) as info:
        await asyncio.wait_for(queued[2], 1)  # batch, and the later of the two batch waiters
    err = info.value
    assert (err.reason, err.status) == ("displaced", 429)
    assert err.retry_after_s >= 1 and err.headers["retry-after"] == str(err.retry_after_s)
    assert "priority 2" in err.message and "priority 0" in err.message
    s = q.stats()
    assert (s["queued"], s["displaced"], s["rejected_full"]) == (4, 1, 0)
    assert s["queued_by_team"] == {"batch": 1, "std": 2, "crit": 1}
    assert s["in_use_by_team"] == {"batch": 2}, "a displaced waiter never held a slot"
    order = []
    for ticket in running:
        q.release(ticket)
    for task in (critical, queued[1], queued[3], queued[0]):  # bands in order, FIFO inside each
        ticket = await asyncio.wait_for(task, 1)
        order.append((ticket.team_id, ticket.priority))
        q.release(ticket)
    assert order == [("crit", 0), ("std", 1), ("std", 1), ("batch", 2)]
    assert_drained(q)


async def test_full_queue_still_refuses_a_request_no_higher_than_every_waiter():
    q = DispatchQueue(capacity=1, max_queued=2)
    blocker = await q.acquire("x", 0)
    queued = await fill(q, [("a", 1), ("b", 1)])
    for priority in (1, 2):  # the same band, then a lower one: nothing to displace
        with pytest.raises(Rejected) as info:
            await q.acquire("late", priority, timeout_s=30)
        assert info.value.reason == "queue_full"
    s = q.stats()
    assert (s["queued"], s["displaced"], s["rejected_full"]) == (2, 0, 2)
    assert not any(t.done() for t in queued)
    q.release(blocker)
    for task in queued:
        q.release(await asyncio.wait_for(task, 1))
    assert_drained(q)


async def test_a_cancelled_waiter_still_queued_is_not_the_one_displaced():
    q = DispatchQueue(capacity=1, max_queued=2)
    blocker = await q.acquire("x", 0)
    early, late = await fill(q, [("batch", 2), ("batch", 2)])
    critical = asyncio.create_task(q.acquire("crit", 0, timeout_s=30))  # runs before `late` resumes:
    late.cancel()  # its future is cancelled, but it is still queued until its task runs
    with pytest.raises(Rejected) as info:
        await asyncio.wait_for(early, 1)
    assert info.value.reason == "displaced"
    with pytest.raises(asyncio.CancelledError):
        await late
    s = q.stats()
    assert (s["queued"], s["displaced"], s["cancelled"]) == (1, 1, 1)
    q.release(blocker)
    q.release(await asyncio.wait_for(critical, 1))
    assert_drained(q)


async def test_displaced_in_the_instant_of_its_deadline_is_shed_once_as_displaced():
    q = DispatchQueue(capacity=1, max_queued=1)
    blocker = await q.acquire("x", 0)
    batch = asyncio.create_task(q.acquire("batch", 2, timeout_s=0.2))
    await settle_loop()
    critical = asyncio.create_task(q.acquire("crit", 0, timeout_s=30))
    time.sleep(0.25)  # block the loop: the critical request's first step and the batch deadline are both due now
    with pytest.raises(Rejected) as info:
        await asyncio.wait_for(batch, 1)
    s = q.stats()
    assert (info.value.reason, s["displaced"], s["timed_out"], s["in_use"]) == ("displaced", 1, 0, 1)
    q.release(blocker)
    q.release(await asyncio.wait_for(critical, 1))
    assert_drained(q)


async def test_displaced_in_the_instant_its_client_leaves_is_cancelled_and_holds_nothing():
    q = DispatchQueue(capacity=1, max_queued=1)
    blocker = await q.acquire("x", 0)
    (batch,) = await fill(q, [("batch", 2)])
    critical = asyncio.create_task(q.acquire("crit", 0, timeout_s=30))
    await asyncio.sleep(0)  # the critical request displaces `batch`, whose task has not resumed yet ...
    assert q.stats()["displaced"] == 1
    batch.cancel()  # ... when its client leaves
    with pytest.raises(asyncio.CancelledError):
        await batch
    s = q.stats()
    assert (s["queued"], s["in_use"], s["cancelled"]) == (1, 1, 0)
    q.release(blocker)
    q.release(await asyncio.wait_for(critical, 1))
    assert_drained(q)
