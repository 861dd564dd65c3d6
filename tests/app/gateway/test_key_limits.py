"""Keys with limits of their own, enforced together with their team's (the tighter wins, atomically), on both state
backends: InMemoryState, and RedisState on the real Redis. Through the real HTTP app (gateway -> fake upstream) for
what a client sees, and against the backends directly for the all-or-nothing reserve and the exact settle.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.state import NOW, URL, drop_redis_prefix, fresh_redis_prefix
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.accounting.usage import seed_key_budgets
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.state.redis import RedisState
from tokenweir.gateway.store.store import Store, UsageRow
from tokenweir.gateway.store.usage import KeyUsageRow
from tokenweir.policies.decisions import Rejected
from tokenweir.policies.limits import KeyLimits, TeamLimits

MODEL, OTHER = "m", "m2"
PROMPT = [101, 102, 103, 104, 105, 106]  # 6 token ids: the gateway's count and the upstream's agree exactly
# USD per 1M tokens = micro-USD per token: a request of 6 prompt + 6 completion tokens costs 6*100 + 6*200 = 1800.
PRICE_IN, PRICE_OUT = 100.0, 200.0


@pytest.fixture(scope="module", params=["memory", "redis"])
def stack(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"keys-{request.param}")
    prefix = fresh_redis_prefix() if request.param == "redis" else None
    state = InMemoryState() if prefix is None else RedisState(URL, prefix=prefix)
    store = Store.open(f"sqlite:///{tmp}/store.db")
    admin_secret, _ = store.create_key(None, "admin", is_admin=True)
    with ServerThread(FakeUpstream(model=MODEL)) as upstream:
        pools = [
            PoolConfig(
                model=name,
                upstreams=[UpstreamConfig(upstream.url)],
                price_input_per_1m=PRICE_IN,
                price_output_per_1m=PRICE_OUT,
            )
            for name in (MODEL, OTHER)
        ]
        config = GatewayConfig(
            port=0,
            pools=pools,
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
        )
        with serve_app(config, store=store, state_backend=state) as gw:
            yield {
                "store": store,
                "url": gw.url,
                "events": tmp / "events.jsonl",
                "state": state,
                "admin": admin_secret,
                "gw": gw,
            }
    store.close()
    if prefix is not None:
        drop_redis_prefix(prefix)


def team_with_keys(stack, team_limits: TeamLimits, key_limits: KeyLimits | None):
    """A fresh team with two keys: one with `key_limits`, one without limits of its own."""
    store = stack["store"]
    team = store.create_team(f"team-{uuid.uuid4().hex[:10]}", team_limits)
    limited_secret, limited = store.create_key(team.id, "limited", limits=key_limits)
    free_secret, _ = store.create_key(team.id, "free")
    return team, (limited_secret, limited), free_secret


def call(stack, secret: str, model: str = MODEL, max_tokens: int = 6, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, **extra}
    headers = {"authorization": f"Bearer {secret}"}
    return httpx.post(stack["url"] + "/v1/completions", json=body, headers=headers, timeout=30)


async def acall(stack, secret: str, **extra) -> httpx.Response:
    return await asyncio.to_thread(call, stack, secret, **extra)


def admin(stack, method: str, path: str, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {stack['admin']}"}
    return httpx.request(method, stack["url"] + path, headers=headers, timeout=30, **kw)


def error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] and err["message"], err
    return err


def live(stack, team_id: str, key_id: str | None = None) -> dict:
    """The app's live counters for the team (or its key), read on the app's own event loop."""
    return stack["gw"].call(stack["state"].snapshot(team_id, key_id=key_id))


def snapshots(stack, team_id: str, key_id: str) -> tuple[dict, dict]:
    return live(stack, team_id), live(stack, team_id, key_id)


# --- through the HTTP app ------------------------------------------------------------------------------------------


def test_a_key_with_rpm_2_gets_429_on_its_third_request_while_its_teammate_is_unaffected(stack):
    team, (limited, _), free = team_with_keys(stack, TeamLimits(rpm=100), KeyLimits(rpm=2))
    assert [call(stack, limited).status_code for _ in range(2)] == [200, 200]
    err = error(call(stack, limited), 429, "rate_limited")
    assert "2 requests per minute" in err["message"] and "API key" in err["message"]
    assert [call(stack, free).status_code for _ in range(3)] == [200, 200, 200]
    assert live(stack, team.id)["requests_last_minute"] == 5  # the refused one took from neither


def test_a_keys_token_budget_stops_it_while_the_team_still_has_budget(stack):
    # each request reserves 12 (6 prompt + max_tokens 6) and uses 12: the key fits 2 (24 of 30), the team many more
    team, (limited, key), free = team_with_keys(stack, TeamLimits(tokens_per_day=1000), KeyLimits(tokens_per_day=30))
    assert [call(stack, limited).status_code for _ in range(2)] == [200, 200]
    err = error(call(stack, limited), 429, "budget_exhausted")
    assert "this API key's daily budget is 30 tokens" in err["message"] and "6 left" in err["message"]
    assert call(stack, free).status_code == 200
    team_snap, key_snap = snapshots(stack, team.id, key.id)
    assert (key_snap["day"]["spent"], team_snap["day"]["spent"]) == (24, 36)


async def test_a_key_runs_at_most_its_max_concurrency_and_its_slots_come_back(stack):
    team, (limited, key), free = team_with_keys(stack, TeamLimits(max_concurrency=10), KeyLimits(max_concurrency=1))
    slow = {"fake": {"ttft_ms": 600}}
    results = await asyncio.gather(
        acall(stack, limited, **slow), acall(stack, limited, **slow), acall(stack, free, **slow)
    )
    codes = sorted(r.status_code for r in results[:2])
    assert codes == [200, 429] and results[2].status_code == 200
    refused = next(r for r in results[:2] if r.status_code == 429)
    assert "this API key may run 1 at once" in error(refused, 429, "concurrency")["message"]
    team_snap, key_snap = snapshots(stack, team.id, key.id)
    assert team_snap["in_flight"] == 0 and key_snap["in_flight"] == 0  # no leaked slot on either
    assert call(stack, limited).status_code == 200


def test_a_key_may_use_only_its_allowed_models(stack):
    _, (limited, _), free = team_with_keys(stack, TeamLimits(), KeyLimits(allowed_models=(MODEL,)))
    assert call(stack, limited).status_code == 200
    err = error(call(stack, limited, model=OTHER), 403, "model_not_allowed")
    assert err["param"] == "model" and "API key" in err["message"]
    assert call(stack, free, model=OTHER).status_code == 200
    error(call(stack, limited, model="no-such-model"), 404, "model_not_found")

    def models(secret: str) -> list[str]:
        headers = {"authorization": f"Bearer {secret}"}
        return [m["id"] for m in httpx.get(stack["url"] + "/v1/models", headers=headers, timeout=30).json()["data"]]

    assert models(limited) == [MODEL] and sorted(models(free)) == [MODEL, OTHER]
    headers = {"authorization": f"Bearer {limited}"}
    assert httpx.get(f"{stack['url']}/v1/models/{OTHER}", headers=headers, timeout=30).status_code == 404


def test_a_spend_budget_stops_a_key_at_its_cap(stack):
    # 1800 micro-USD a request: $0.004 fits 2 (3600), not a third
    team, (limited, key), free = team_with_keys(stack, TeamLimits(usd_per_day=1.0), KeyLimits(usd_per_day=0.004))
    assert [call(stack, limited).status_code for _ in range(2)] == [200, 200]
    err = error(call(stack, limited), 429, "budget_exhausted")
    assert "this API key's daily spend budget is $0.004" in err["message"], err
    assert call(stack, free).status_code == 200
    team_snap, key_snap = snapshots(stack, team.id, key.id)
    assert key_snap["day_usd"]["spent"] == pytest.approx(0.0036)
    assert team_snap["day_usd"]["spent"] == pytest.approx(0.0054)


def test_a_spend_budget_stops_a_team_at_its_cap_whatever_the_key(stack):
    _, (limited, _), free = team_with_keys(stack, TeamLimits(usd_per_month=0.002), None)
    assert call(stack, limited).status_code == 200
    err = error(call(stack, free), 429, "budget_exhausted")
    assert "the team's monthly spend budget" in err["message"]


def test_v1_me_shows_the_keys_remaining_and_its_teams(stack):
    team, (limited, key), _ = team_with_keys(
        stack, TeamLimits(tokens_per_day=1000, rpm=50), KeyLimits(tokens_per_day=100, rpm=5, usd_per_day=0.01)
    )
    assert call(stack, limited).status_code == 200
    r = httpx.get(stack["url"] + "/v1/me", headers={"authorization": f"Bearer {limited}"}, timeout=30)
    assert r.status_code == 200, r.text
    me = r.json()
    assert me["key"]["id"] == key.id and me["key"]["limits"]["tokens_per_day"] == 100
    assert me["key"]["state"]["day"]["remaining"] == 88 and me["key"]["state"]["remaining_requests"] == 4
    assert me["team"]["id"] == team.id and me["team"]["state"]["day"]["remaining"] == 988
    assert me["remaining"]["tokens_today"] == 88 and me["remaining"]["requests_per_minute"] == 4
    assert me["remaining"]["usd_today"] == pytest.approx(0.0082)
    assert me["remaining"]["tokens_per_minute"] is None  # neither has a tpm limit
    r = httpx.get(stack["url"] + "/v1/me", headers={"authorization": "Bearer tw-" + "x" * 43}, timeout=30)
    error(r, 401, "invalid_api_key")


def test_events_carry_key_id_user_and_cost_and_usage_groups_by_key_and_user(stack):
    team, (limited, key), free = team_with_keys(stack, TeamLimits(), KeyLimits(rpm=100))
    assert call(stack, limited, user="alice").status_code == 200
    assert call(stack, free, user="u" * 300).status_code == 200
    events = [e for e in read_events(stack["events"]) if e["team"] == team.id]
    assert len(events) == 2
    first, second = events
    assert (first["key_id"], first["user"], first["cost"]) == (key.id, "alice", 0.0018)
    assert second["user"] == "u" * 256 + "..." and second["key_id"] != key.id
    deadline = time.monotonic() + 10
    while True:
        by_user = admin(stack, "GET", "/admin/usage", params={"team_id": team.id, "group_by": "user"}).json()
        if len(by_user["data"]) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    users = {row["user"]: row for row in by_user["data"]}
    assert users["alice"]["cost_usd"] == 0.0018 and users["alice"]["requests"] == 1
    assert by_user["total"]["cost_usd"] == pytest.approx(0.0036)
    by_key = admin(stack, "GET", "/admin/usage", params={"team_id": team.id, "group_by": "key"}).json()
    assert {row["key_id"] for row in by_key["data"]} == {key.id, second["key_id"]}
    error(admin(stack, "GET", "/admin/usage", params={"group_by": "model"}), 400, "invalid_value")


def test_a_settle_refunds_the_unused_hold_to_the_key_and_the_team_exactly(stack):
    team, (limited, key), _ = team_with_keys(
        stack, TeamLimits(tokens_per_day=500, tpm=500), KeyLimits(tokens_per_day=100, tpm=100, usd_per_day=1.0)
    )
    # holds 6 + 20 = 26 tokens and 6*100 + 20*200 = 4600 micro-USD; the upstream makes 2: 8 tokens, 1000 micro-USD
    assert call(stack, limited, max_tokens=20, fake={"tokens": 2}).status_code == 200
    for snap in snapshots(stack, team.id, key.id):
        assert (snap["day"]["spent"], snap["day"]["reserved"], snap["tokens_last_minute"]) == (8, 0, 8), snap
        assert snap["open_reservations"] == 0 and snap["reserved_tokens"] == 0
        assert snap["day_usd"]["spent"] == pytest.approx(0.001) and snap["day_usd"]["reserved"] == 0


def test_admin_api_creates_reads_and_replaces_a_keys_limits(stack):
    team = stack["store"].create_team(f"team-{uuid.uuid4().hex[:10]}", TeamLimits())
    body = {"name": "ci", "limits": {"rpm": 2, "tokens_per_month": 10_000, "usd_per_day": 5, "allowed_models": [MODEL]}}
    r = admin(stack, "POST", f"/admin/teams/{team.id}/keys", json=body)
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["limits"]["rpm"] == 2 and created["limits"]["allowed_models"] == [MODEL]
    key_id = created["id"]
    got = admin(stack, "GET", f"/admin/keys/{key_id}/limits").json()
    assert got["tokens_per_month"] == 10_000 and got["usd_per_day"] == 5 and got["max_concurrency"] is None
    r = admin(stack, "PUT", f"/admin/keys/{key_id}/limits", json={"max_concurrency": 3})
    assert r.status_code == 200 and r.json()["max_concurrency"] == 3 and r.json()["rpm"] is None
    assert stack["store"].get_key(key_id).limits == KeyLimits(max_concurrency=3)
    assert admin(stack, "PUT", f"/admin/keys/{key_id}/limits", json={}).status_code == 200
    assert stack["store"].get_key(key_id).limits is None  # no limits of its own: only the team's apply

    err = error(admin(stack, "PUT", f"/admin/keys/{key_id}/limits", json={"rpm": 0}), 400, "invalid_value")
    assert err["param"] == "rpm"
    err = error(admin(stack, "PUT", f"/admin/keys/{key_id}/limits", json={"models": ["x"]}), 400, "unknown_parameter")
    bad = {"name": "k", "limits": {"usd_per_day": -1}}
    err = error(admin(stack, "POST", f"/admin/teams/{team.id}/keys", json=bad), 400, "invalid_value")
    assert err["param"] == "limits.usd_per_day"
    error(admin(stack, "GET", "/admin/keys/key_nope/limits"), 404, "key_not_found")
    error(admin(stack, "POST", "/admin/keys", json={"name": "a", "limits": {"rpm": 1}}), 400, "invalid_value")


# --- the backends directly -----------------------------------------------------------------------------------------


async def test_a_request_refused_by_the_team_takes_nothing_from_its_key(state_replicas):
    state, _ = state_replicas
    team, key = TeamLimits(tokens_per_day=20), KeyLimits(tokens_per_day=1000, rpm=10)
    await state.reserve("t", team, 5, 10, now=NOW, key_id="k", key_limits=key)
    with pytest.raises(Rejected) as info:
        await state.reserve("t", team, 5, 10, now=NOW, key_id="k", key_limits=key)
    assert "the team's daily budget is 20 tokens" in info.value.message
    snap = await state.snapshot("t", now=NOW, key_id="k")
    assert (snap["day"]["reserved"], snap["requests_last_minute"], snap["open_reservations"]) == (15, 1, 1)


async def test_200_concurrent_reserves_admit_what_the_tighter_of_key_and_team_allows(state_replicas):
    a, b = state_replicas
    team, key = TeamLimits(rpm=150, tokens_per_day=100_000), KeyLimits(tokens_per_day=1000)  # 100 tokens each

    async def one(i):
        try:
            return await (a, b)[i % 2].reserve("t", team, 40, 60, now=NOW, key_id="k", key_limits=key)
        except Rejected as err:
            return err

    results = await asyncio.gather(*[one(i) for i in range(200)])
    admitted = [r for r in results if not isinstance(r, Rejected)]
    assert len(admitted) == 10
    assert (await a.snapshot("t", now=NOW))["day"]["reserved"] == 1000  # the team counted exactly the key's admissions
    await asyncio.gather(*[(a, b)[i % 2].settle(r, 40, 10, now=NOW, cost=0) for i, r in enumerate(admitted)])
    await asyncio.gather(*[b.settle(r, 40, 99, now=NOW) for r in admitted])  # a second settle changes nothing
    for snap in (await a.snapshot("t", now=NOW), await a.snapshot("t", now=NOW, key_id="k")):
        assert (snap["day"]["spent"], snap["day"]["reserved"], snap["open_reservations"]) == (500, 0, 0), snap


async def test_a_key_without_limits_counts_its_spend_and_is_never_refused_by_it(state_replicas):
    # counted anyway, so a budget added later starts from what the key already spent (test_limits_added_midday)
    state, _ = state_replicas
    for limits in (KeyLimits(), None):
        res = await state.reserve("t", TeamLimits(rpm=5), 1, 1, now=NOW, key_id="k", key_limits=limits, cost=7)
        assert res.key_id == "k"
        await state.settle(res, 1, 0, now=NOW, cost=3 * 10**9)  # exact cost in femto-USD: 3 micro-USD
    key = await state.snapshot("t", now=NOW, key_id="k")
    assert (key["day"]["spent"], key["day"]["remaining"], key["day_usd"]["spent"]) == (2, None, 0.000006)
    assert (await state.snapshot("t", now=NOW))["requests_last_minute"] == 2


async def test_key_slots_are_taken_with_the_teams_and_given_back_to_both(state_replicas):
    state, _ = state_replicas
    assert await state.acquire_slot("t", 3, key_id="k", key_max=1)
    assert not await state.acquire_slot("t", 3, key_id="k", key_max=1)  # the key is full, the team is not
    assert await state.acquire_slot("t", 3)
    assert await state.acquire_slot("t", 3, key_id="j", key_max=5)
    assert not await state.acquire_slot("t", 3, key_id="j", key_max=5)  # now the team is full
    assert (await state.snapshot("t"))["in_flight"] == 3 and (await state.snapshot("t", key_id="j"))["in_flight"] == 1
    await state.release_slot("t", key_id="k")
    await state.release_slot("t", key_id="j")
    await state.release_slot("t")
    assert (await state.snapshot("t"))["in_flight"] == 0 and (await state.snapshot("t", key_id="k"))["in_flight"] == 0
    with pytest.raises(AssertionError):
        await state.release_slot("t", key_id="k")


async def test_a_restart_seeds_the_keys_budgets_and_the_teams_spend_from_the_store(state_replicas, tmp_path):
    state, _ = state_replicas
    store = Store.open(f"sqlite:///{tmp_path}/seed.db")
    today = time.strftime("%Y-%m-%d", time.gmtime())
    store.record_usage(
        [UsageRow("t", today, MODEL, 2, 60, 40, 0)],
        key_rows=[
            KeyUsageRow("t", "k", "alice", today, MODEL, 1, 30, 20, 0, 4000),
            KeyUsageRow("t", "j", "", today, MODEL, 1, 30, 20, 0, 1000),
        ],
    )
    await seed_key_budgets(store, state)
    key, team = await state.snapshot("t", key_id="k"), await state.snapshot("t")
    assert (key["day"]["spent"], key["month"]["spent"], key["day_usd"]["spent"]) == (50, 50, 0.004)
    assert (team["day"]["spent"], team["day_usd"]["spent"], team["month_usd"]["spent"]) == (100, 0.005, 0.005)
    with pytest.raises(Rejected) as info:  # the key's $0.0045 a day is almost gone: a restart did not refill it
        await state.reserve("t", TeamLimits(), 1, 1, key_id="k", key_limits=KeyLimits(usd_per_day=0.0045), cost=600)
    assert "this API key's daily spend budget" in info.value.message
    store.close()
