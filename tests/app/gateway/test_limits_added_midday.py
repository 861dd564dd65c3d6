"""Limits added or changed at run time apply to what was already spent in the period, on both state backends: a key
(or team) that spent without limits and then gets a budget below its spend is refused at once, and /v1/me shows the
truth at once, before any request has run under the new limits. Through the real HTTP app (gateway -> fake upstream,
the admin API for the change), and against the backends directly for holds still in flight when the limit arrives.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.app.gateway import test_key_limits
from tests.app.gateway.test_key_limits import admin, call, error, team_with_keys
from tests.support.state import NOW
from tokenweir.policies.decisions import Rejected
from tokenweir.policies.limits import KeyLimits, TeamLimits

stack = test_key_limits.stack  # the gateway on each state backend (one per module)

# Each call: 6 prompt + 6 completion tokens at 100 / 200 micro-USD a token = 12 tokens, 1800 micro-USD.
TOKENS, MICROS = 12, 1800


def me(stack, secret: str) -> dict:
    r = httpx.get(stack["url"] + "/v1/me", headers={"authorization": f"Bearer {secret}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def spend(stack, secret: str, calls: int) -> None:
    assert [call(stack, secret).status_code for _ in range(calls)] == [200] * calls


@pytest.mark.parametrize(
    ("field", "limit", "remaining", "words"),
    [
        ("tokens_per_day", 30, "tokens_today", "this API key's daily budget is 30 tokens"),
        ("usd_per_day", 0.005, "usd_today", "this API key's daily spend budget is $0.005"),
    ],
)
def test_a_key_that_spent_without_limits_is_refused_at_once_when_given_a_budget_below_its_spend(
    stack, field, limit, remaining, words
):
    _, (secret, key), free = team_with_keys(stack, TeamLimits(), None)
    spend(stack, secret, 3)  # 36 tokens, $0.0054
    r = admin(stack, "PUT", f"/admin/keys/{key.id}/limits", json={field: limit})
    assert r.status_code == 200, r.text
    info = me(stack, secret)
    assert info["remaining"][remaining] == 0, info
    assert info["key"]["state"]["day"]["spent"] == 3 * TOKENS and info["key"]["limits"][field] == limit
    assert words in error(call(stack, secret), 429, "budget_exhausted")["message"]
    assert call(stack, free).status_code == 200  # its teammate spent nothing: the key's limit is its own


def test_a_keys_raised_budget_counts_what_it_spent_and_a_lowered_one_refuses_at_once(stack):
    _, (secret, key), _ = team_with_keys(stack, TeamLimits(), None)
    spend(stack, secret, 3)
    assert admin(stack, "PUT", f"/admin/keys/{key.id}/limits", json={"tokens_per_day": 100}).status_code == 200
    assert me(stack, secret)["remaining"]["tokens_today"] == 100 - 3 * TOKENS
    spend(stack, secret, 1)
    assert admin(stack, "PUT", f"/admin/keys/{key.id}/limits", json={"tokens_per_day": 50}).status_code == 200
    assert me(stack, secret)["remaining"]["tokens_today"] == 50 - 4 * TOKENS
    assert "2 left" in error(call(stack, secret), 429, "budget_exhausted")["message"]


def test_a_team_that_spent_without_limits_is_refused_at_once_and_v1_me_says_so_before_any_request(stack):
    team, (secret, _), free = team_with_keys(stack, TeamLimits(), None)
    spend(stack, secret, 2)
    spend(stack, free, 1)
    r = admin(stack, "PUT", f"/admin/teams/{team.id}/limits", json={"tokens_per_day": 30, "usd_per_day": 0.01})
    assert r.status_code == 200, r.text
    info = me(stack, free)
    assert info["team"]["state"]["day"]["limit"] == 30 and info["team"]["state"]["day"]["spent"] == 3 * TOKENS
    assert info["remaining"]["tokens_today"] == 0
    assert info["remaining"]["usd_today"] == pytest.approx(0.01 - 3 * MICROS / 1e6)
    assert "the team's daily budget is 30 tokens" in error(call(stack, free), 429, "budget_exhausted")["message"]
    live = admin(stack, "GET", f"/admin/teams/{team.id}/state").json()["live"]
    assert (live["day"]["limit"], live["remaining_day"]) == (30, 0)


def test_v1_me_shows_a_new_keys_budget_before_its_first_request(stack):
    _, (secret, _), _ = team_with_keys(stack, TeamLimits(tokens_per_month=500), KeyLimits(tokens_per_day=100, rpm=7))
    info = me(stack, secret)
    assert info["remaining"]["tokens_today"] == 100 and info["remaining"]["tokens_this_month"] == 500
    assert info["remaining"]["requests_per_minute"] == 7 and info["remaining"]["usd_today"] is None


# --- the backends directly -----------------------------------------------------------------------------------------


async def test_holds_taken_before_a_keys_limit_count_against_it_so_concurrent_requests_cannot_slip_through(
    state_replicas,
):
    a, b = state_replicas
    team = TeamLimits()
    # 20 requests of 100 held while the key had no limits, from two replicas; none settled yet
    held = await asyncio.gather(*[(a, b)[i % 2].reserve("t", team, 50, 50, now=NOW, key_id="k") for i in range(20)])
    limited = KeyLimits(tokens_per_day=2500)

    async def one(i):
        try:
            return await (a, b)[i % 2].reserve("t", team, 50, 50, now=NOW, key_id="k", key_limits=limited)
        except Rejected as err:
            return err

    results = await asyncio.gather(*[one(i) for i in range(40)])
    assert sum(not isinstance(r, Rejected) for r in results) == 5  # 2500 - 2000 held leaves room for 5
    await asyncio.gather(*[a.settle(r, 50, 0, now=NOW) for r in held])  # each used 50 of its 100
    snap = await a.snapshot("t", now=NOW, key_id="k")
    assert (snap["day"]["spent"], snap["day"]["reserved"], snap["open_reservations"]) == (1000, 500, 5), snap
