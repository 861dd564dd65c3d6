"""InMemoryState: atomic reservations under concurrency, settle refunds, idempotence, slots, rollover."""

import asyncio
from datetime import UTC, datetime

import pytest

from gateway.state import InMemoryState
from policies.decisions import Rejected
from policies.limits import TeamLimits

NOW = datetime(2026, 5, 10, 12, 0, tzinfo=UTC).timestamp()


async def reserve_many(state, limits, n, prompt, max_tokens, now=NOW):
    async def one():
        try:
            return await state.reserve("t", limits, prompt, max_tokens, now=now)
        except Rejected as err:
            return err

    results = await asyncio.gather(*[one() for _ in range(n)])
    admitted = [r for r in results if not isinstance(r, Rejected)]
    rejected = [r for r in results if isinstance(r, Rejected)]
    return admitted, rejected


@pytest.mark.parametrize(
    ("limits", "admits", "reason"),
    [
        (TeamLimits(tokens_per_day=1000), 10, "budget_exhausted"),  # 100 tokens each
        (TeamLimits(tokens_per_month=2550), 25, "budget_exhausted"),
        (TeamLimits(rpm=37), 37, "rate_limited"),
        (TeamLimits(tpm=4321), 43, "rate_limited"),
        (TeamLimits(rpm=50, tpm=10_000, tokens_per_day=3000), 30, "budget_exhausted"),
    ],
)
async def test_200_concurrent_reserves_admit_exactly_what_fits(limits, admits, reason):
    state = InMemoryState()
    admitted, rejected = await reserve_many(state, limits, 200, prompt=40, max_tokens=60)
    assert len(admitted) == admits
    assert {r.reason for r in rejected} == {reason}
    snap = state.snapshot("t", now=NOW)
    assert snap["reserved_tokens"] == admits * 100
    assert snap["open_reservations"] == admits


async def test_reservations_interleaved_with_awaits_still_cannot_overrun():
    state = InMemoryState()
    limits = TeamLimits(tokens_per_day=5000)
    admitted = []

    async def client(i):
        for _ in range(5):
            await asyncio.sleep(0)
            try:
                res = await state.reserve("t", limits, 50, 150, now=NOW)
            except Rejected:
                continue
            admitted.append(res)
            snap = state.snapshot("t", now=NOW)
            assert snap["day"]["spent"] + snap["day"]["reserved"] <= 5000
            await asyncio.sleep(0)
            if i % 2:
                await state.settle(res, 50, 20, now=NOW)

    await asyncio.gather(*[client(i) for i in range(40)])
    snap = state.snapshot("t", now=NOW)
    assert snap["day"]["spent"] + snap["day"]["reserved"] <= 5000
    assert len(admitted) > 25  # refunds from settles let more in than 5000 / 200


async def test_settle_refunds_the_unused_part_everywhere():
    state = InMemoryState()
    limits = TeamLimits(tpm=1000, tokens_per_day=1000, tokens_per_month=5000)
    res = await state.reserve("t", limits, 100, 500, now=NOW)
    assert res.tokens == 600
    assert res.headers["x-ratelimit-remaining-tokens"] == "400"
    await state.settle(res, 100, 50, now=NOW + 1)
    snap = state.snapshot("t", now=NOW + 1)
    assert snap["tokens_last_minute"] == 150
    assert snap["day"] | {"resets_in_s": 0} == {
        "period": "2026-05-10",
        "limit": 1000,
        "spent": 150,
        "reserved": 0,
        "remaining": 850,
        "overshoot": 0,
        "resets_in_s": 0,
    }
    assert snap["remaining_month"] == 4850
    assert snap["reserved_tokens"] == 0 and snap["open_reservations"] == 0
    assert res.settled and res.actual_tokens == 150


async def test_settle_is_idempotent():
    state = InMemoryState()
    limits = TeamLimits(tokens_per_day=1000)
    res = await state.reserve("t", limits, 10, 90, now=NOW)
    await asyncio.gather(*[state.settle(res, 10, 40, now=NOW) for _ in range(5)])
    await state.settle(res, 10, 90, now=NOW)  # a late, different settle changes nothing either
    snap = state.snapshot("t", now=NOW)
    assert (snap["spent_today"], snap["reserved_tokens"], snap["remaining_day"]) == (50, 0, 950)


async def test_overshoot_is_charged_in_full():
    state = InMemoryState()
    limits = TeamLimits(tpm=1000, tokens_per_day=1000)
    res = await state.reserve("t", limits, 10, 90, now=NOW)
    await state.settle(res, 10, 140, now=NOW)
    snap = state.snapshot("t", now=NOW)
    assert snap["spent_today"] == 150 and snap["day"]["overshoot"] == 50
    assert snap["tokens_last_minute"] == 150
    assert res.overshoot == 50


async def test_settling_nothing_refunds_everything_but_the_request():
    state = InMemoryState()
    limits = TeamLimits(rpm=10, tokens_per_day=100)
    res = await state.reserve("t", limits, 20, 80, now=NOW)
    await state.settle(res, 0, 0, now=NOW)
    snap = state.snapshot("t", now=NOW)
    assert (snap["remaining_day"], snap["requests_last_minute"]) == (100, 1)


async def test_a_rejection_takes_nothing():
    state = InMemoryState()
    limits = TeamLimits(rpm=10, tpm=100, tokens_per_day=1000)
    with pytest.raises(Rejected) as info:
        await state.reserve("t", limits, 60, 60, now=NOW)  # 120 tokens > tpm 100, can never fit
    assert info.value.reason == "rate_limited" and "too large" in info.value.message
    snap = state.snapshot("t", now=NOW)
    assert (snap["requests_last_minute"], snap["tokens_last_minute"], snap["reserved_tokens"]) == (0, 0, 0)


async def test_rate_rejection_has_headers_and_a_window_retry_after():
    state = InMemoryState()
    limits = TeamLimits(rpm=2, tpm=1000)
    await state.reserve("t", limits, 1, 1, now=NOW)
    await state.reserve("t", limits, 1, 1, now=NOW + 10)
    with pytest.raises(Rejected) as info:
        await state.reserve("t", limits, 1, 1, now=NOW + 20)
    err = info.value
    assert (err.reason, err.status) == ("rate_limited", 429)
    assert 1 <= err.retry_after_s <= 61
    assert err.retry_after_s == 41  # the first request's slot frees at NOW + 61
    assert err.headers["x-ratelimit-limit-requests"] == "2"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert err.headers["x-ratelimit-limit-tokens"] == "1000"
    assert err.headers["x-ratelimit-remaining-tokens"] == "996"
    assert err.headers["retry-after"] == "41"
    assert await state.reserve("t", limits, 1, 1, now=NOW + 61)


async def test_budget_rejection_waits_for_the_next_utc_day():
    state = InMemoryState()
    limits = TeamLimits(tokens_per_day=100)
    late = datetime(2026, 5, 10, 23, 0, tzinfo=UTC).timestamp()
    await state.reserve("t", limits, 50, 50, now=late)
    with pytest.raises(Rejected) as info:
        await state.reserve("t", limits, 1, 1, now=late)
    assert info.value.reason == "budget_exhausted"
    assert info.value.retry_after_s == 3600
    assert "daily" in info.value.message and "100" in info.value.message and "3600s" in info.value.message
    # midnight: a fresh day admits again; yesterday's hold settles onto today's spend
    midnight = late + 3600
    res = await state.reserve("t", limits, 10, 10, now=midnight)
    assert state.snapshot("t", now=midnight)["remaining_day"] == 80
    await state.settle(res, 10, 10, now=midnight)


async def test_settle_across_midnight_charges_the_new_day():
    state = InMemoryState()
    limits = TeamLimits(tokens_per_day=1000)
    late = datetime(2026, 5, 10, 23, 59, 59, tzinfo=UTC).timestamp()
    res = await state.reserve("t", limits, 100, 400, now=late)
    await state.settle(res, 100, 200, now=late + 2)
    snap = state.snapshot("t", now=late + 2)
    assert (snap["day"]["period"], snap["spent_today"], snap["day"]["reserved"]) == ("2026-05-11", 300, 0)
    assert snap["reserved_tokens"] == 0


async def test_seed_spend_counts_against_budgets():
    state = InMemoryState()
    state.seed_spend("t", day_tokens=900, month_tokens=9_900, now=NOW)
    limits = TeamLimits(tokens_per_day=1000, tokens_per_month=10_000)
    with pytest.raises(Rejected):
        await state.reserve("t", limits, 50, 60, now=NOW)
    assert await state.reserve("t", limits, 50, 50, now=NOW)
    assert state.snapshot("t", now=NOW)["remaining_month"] == 0


async def test_limits_changed_live_apply_to_existing_counts():
    state = InMemoryState()
    await state.reserve("t", TeamLimits(rpm=10), 1, 1, now=NOW)
    await state.reserve("t", TeamLimits(rpm=10), 1, 1, now=NOW)
    with pytest.raises(Rejected):
        await state.reserve("t", TeamLimits(rpm=2), 1, 1, now=NOW)
    assert await state.reserve("t", TeamLimits(rpm=None), 1, 1, now=NOW)


async def test_teams_are_independent():
    state = InMemoryState()
    limits = TeamLimits(tokens_per_day=100)
    await state.reserve("a", limits, 50, 50, now=NOW)
    assert await state.reserve("b", limits, 50, 50, now=NOW)
    assert state.snapshot("a", now=NOW)["remaining_day"] == 0


async def test_concurrency_slots():
    state = InMemoryState()
    assert [await state.acquire_slot("t", 2) for _ in range(3)] == [True, True, False]
    await state.release_slot("t")
    assert await state.acquire_slot("t", 2)
    assert state.snapshot("t")["in_flight"] == 2
    assert all([await state.acquire_slot("u", None) for _ in range(50)])
    with pytest.raises(AssertionError):
        await state.release_slot("never-acquired")


async def test_slots_survive_a_cancellation_storm():
    state = InMemoryState()
    started = asyncio.Event()

    async def request():
        if not await state.acquire_slot("t", 100):
            return
        try:
            started.set()
            await asyncio.sleep(10)
        finally:
            await state.release_slot("t")

    tasks = [asyncio.create_task(request()) for _ in range(60)]
    await started.wait()
    assert state.snapshot("t")["in_flight"] == 60
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert state.snapshot("t")["in_flight"] == 0


def test_snapshot_of_an_unknown_team_is_zero():
    snap = InMemoryState().snapshot("nobody", now=NOW)
    assert (snap["in_flight"], snap["reserved_tokens"], snap["spent_today"], snap["remaining_day"]) == (0, 0, 0, None)


async def test_a_request_larger_than_the_whole_budget_says_so():
    state = InMemoryState()
    with pytest.raises(Rejected) as info:
        await state.reserve("t", TeamLimits(tokens_per_month=500), 100, 401, now=NOW)
    assert info.value.reason == "budget_exhausted"
    assert "501" in info.value.message and "whole budget is 500" in info.value.message
