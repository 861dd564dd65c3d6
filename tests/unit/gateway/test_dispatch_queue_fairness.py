"""The dispatch queue's fairness by tokens against by requests, on real asyncio: a team of long requests and a team
of short ones, both backlogged on one slot."""

from __future__ import annotations

import asyncio

import pytest

from tokenweir.gateway.request.queue import DispatchQueue

HEAVY = (2000, 500)  # prompt tokens, output tokens
LIGHT = (100, 25)


async def dispatch_order(fairness: str, n: int = 30) -> list[str]:
    """Which team each slot went to, with `n` requests of each team waiting behind a held slot; each request's
    output is charged when it gives its slot back."""
    q = DispatchQueue(capacity=1, max_queued=1000, fairness=fairness)
    blocker = await q.acquire("other", 1)
    order: list[str] = []

    async def one(team: str, prompt: int, output: int) -> None:
        ticket = await q.acquire(team, 1, 1, 30, prompt)
        order.append(team)
        await asyncio.sleep(0)
        q.release(ticket, output)

    tasks = [asyncio.create_task(one("heavy", *HEAVY)) for _ in range(n)]
    tasks += [asyncio.create_task(one("light", *LIGHT)) for _ in range(n)]
    for _ in range(3):
        await asyncio.sleep(0)
    q.release(blocker)
    await asyncio.gather(*tasks)
    assert q.stats()["in_use"] == 0 and q.stats()["queued"] == 0
    return order


async def test_fcfs_serves_in_arrival_order_whatever_the_team():
    assert await dispatch_order("fcfs", 10) == ["heavy"] * 10 + ["light"] * 10


async def test_by_requests_the_teams_alternate_and_by_tokens_the_short_team_goes_first():
    by_requests = await dispatch_order("requests")
    assert by_requests[:10] == ["heavy", "light"] * 5  # one request each, whatever it costs
    by_tokens = await dispatch_order("tokens")
    # a heavy request costs 3000 weighted tokens, a light one 150: light runs ~20 to each heavy one until it is done
    first_20 = by_tokens[:20]
    assert first_20.count("light") >= 18, first_20
    assert by_tokens.index("heavy") <= 1  # the heavy team is served too, not starved: one of the first two


@pytest.mark.parametrize("fairness", ["tokens", "requests"])
async def test_a_slot_found_free_counts_as_service_only_by_tokens(fairness):
    """Service is service: by tokens, a team let in at once (no queue) is charged too, so it does not come first
    again when a queue forms; by requests, only dispatches from the queue count (today's stride)."""
    q = DispatchQueue(capacity=1, max_queued=10, fairness=fairness)
    early = await q.acquire("early", 1, 1, 30, 5000)  # alone: a free slot
    waiting = [asyncio.create_task(q.acquire(t, 1, 1, 30, 10)) for t in ("early", "late")]
    for _ in range(3):
        await asyncio.sleep(0)
    q.release(early, 1000)
    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    first = done.pop().result()
    assert first.team_id == ("late" if fairness == "tokens" else "early")
    q.release(first)
    q.release(await asyncio.wait_for(next(t for t in waiting if not t.done()), 1))


def test_a_pool_or_the_bundled_engines_names_a_known_fairness():
    from tokenweir.gateway.config import PoolConfig
    from tokenweir.gateway.config.engine import BundledEngineConfig

    with pytest.raises(ValueError, match="fairness is one of tokens, requests, fcfs"):
        PoolConfig(model="m", fairness="lottery")
    with pytest.raises(ValueError, match="output_token_weight"):
        PoolConfig(model="m", output_token_weight=-1)
    with pytest.raises(ValueError, match="fairness one of tokens, requests, fcfs"):
        BundledEngineConfig(fairness="lottery")
    assert PoolConfig(model="m").fairness == BundledEngineConfig().fairness == "tokens"
