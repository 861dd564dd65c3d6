"""Runtime pools and aliases through the admin API, on two gateway replicas sharing one store file: a member added,
drained and removed under load with no 5xx and one event per request; an alias change reaching the other replica
within 5 s; the admin API's refusals (a dangling name, a key in the body, an unknown pool or member); racing admin
writes on both replicas waiting for the file's lock, never a 503."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, two_replicas
from tests.support.stack import team
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig

PROMPT = [101, 102, 103]


@pytest.fixture
def replicas(tmp_path):
    """Two replicas (each its own store connection to one SQLite file) in front of three fake upstreams."""
    fakes = [FakeUpstream(model="m") for _ in range(3)]
    with ServerThread(fakes[0]) as u0, ServerThread(fakes[1]) as u1, ServerThread(fakes[2]) as u2:

        def config(name: str) -> GatewayConfig:
            return GatewayConfig(
                port=0,
                pools=[
                    PoolConfig("m", [UpstreamConfig(u0.url, name="u0", model="m")], capacity=256),
                    PoolConfig("other", [UpstreamConfig(u2.url, name="o0", model="m")]),
                ],
                events=EventsConfig(path=str(tmp_path / f"events-{name}.jsonl"), flush_interval_s=0.05),
                routing_poll_interval_s=0.2,
            )

        with two_replicas(tmp_path, config) as (store, (a, b), admin):
            yield {
                "store": store,
                "urls": [a.url, b.url],
                "upstreams": [u0.url, u1.url, u2.url],
                "fakes": fakes,
                "admin": admin,
                "events": [tmp_path / "events-a.jsonl", tmp_path / "events-b.jsonl"],
            }


async def test_members_added_drained_and_removed_under_load_never_fail_a_request(replicas):
    _, secret = team(replicas)
    a, b = replicas["urls"]
    stop = asyncio.Event()
    statuses: Counter = Counter()
    ids: list[str] = []

    async def client(c: httpx.AsyncClient) -> None:
        while not stop.is_set():
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "fake": {"tokens": 4, "ttft_ms": 20}}
            r = await c.post("/v1/completions", json=body)
            statuses[r.status_code] += 1
            ids.append(r.headers.get("x-request-id", ""))

    admin = httpx.AsyncClient(base_url=a, headers=replicas["admin"], timeout=30)
    clients = [
        httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {secret}"}, timeout=30) for url in (a, b) * 4
    ]
    load = [asyncio.create_task(client(c)) for c in clients]
    try:
        await asyncio.sleep(1.0)
        r = await admin.post("/admin/pools/m/members", json={"base_url": replicas["upstreams"][1], "name": "u1"})
        assert r.status_code == 201, r.text
        assert [m["name"] for m in r.json()["members"]] == ["u0", "u1"]
        await asyncio.sleep(1.5)
        r = await admin.patch("/admin/pools/m/members/u0", json={"draining": True})
        assert r.status_code == 200 and r.json()["members"][0]["draining"] is True, r.text
        await asyncio.sleep(1.0)  # both replicas have seen it (0.2 s polls); u0's requests finished meanwhile
        drained_at = replicas["fakes"][0].requests_seen
        await asyncio.sleep(1.0)
        assert replicas["fakes"][0].requests_seen == drained_at  # nothing new reached the drained member
        r = await admin.delete("/admin/pools/m/members/u0")
        assert r.status_code == 200 and [m["name"] for m in r.json()["members"]] == ["u1"], r.text
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await asyncio.gather(*load)
        for c in [admin, *clients]:
            await c.aclose()
    assert set(statuses) == {200}, statuses
    assert replicas["fakes"][1].requests_seen > 20  # the added member served
    await asyncio.sleep(0.3)  # the last events' flush
    events = [e for path in replicas["events"] for e in read_events(path) if e.get("request_id") in set(ids)]
    assert sorted(e["request_id"] for e in events) == sorted(ids)  # one event per request, on the replica it hit
    assert {e["instance"] for e in events} == {"m@u0", "m@u1"}


async def test_an_alias_change_reaches_the_other_replica_within_5_s(replicas):
    _, secret = team(replicas)
    a, b = replicas["urls"]
    async with (
        httpx.AsyncClient(base_url=a, headers=replicas["admin"], timeout=30) as admin,
        httpx.AsyncClient(base_url=b, headers={"authorization": f"Bearer {secret}"}, timeout=30) as on_b,
    ):
        alias = {"model": "chat", "variants": [{"pool": "m", "weight": 1, "name": "one"}]}
        assert (await admin.put("/admin/aliases/chat", json=alias)).status_code == 200
        changed = time.monotonic()
        while (await on_b.post("/v1/completions", json={"model": "chat", "prompt": PROMPT})).status_code != 200:
            assert time.monotonic() - changed < 5, "the alias did not reach replica b within 5 s"
            await asyncio.sleep(0.05)
        alias["variants"] = [{"pool": "other", "weight": 1, "name": "two"}]
        assert (await admin.put("/admin/aliases/chat", json=alias)).status_code == 200
        changed = time.monotonic()
        while True:
            r = await on_b.post("/v1/completions", json={"model": "chat", "prompt": PROMPT})
            assert r.status_code == 200, r.text
            if replicas["fakes"][2].requests_seen:
                break
            assert time.monotonic() - changed < 5, "the new weights did not reach replica b within 5 s"
        models = (await on_b.get("/v1/models")).json()["data"]
        assert "chat" in {m["id"] for m in models}
        assert (await admin.delete("/admin/aliases/chat")).status_code == 200
        await asyncio.sleep(0.6)
        r = await on_b.post("/v1/completions", json={"model": "chat", "prompt": PROMPT})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_a_pool_added_at_run_time_serves_and_a_removed_one_is_gone(replicas):
    _, secret = team(replicas)
    a, b = replicas["urls"]
    async with (
        httpx.AsyncClient(base_url=a, headers=replicas["admin"], timeout=30) as admin,
        httpx.AsyncClient(base_url=b, headers={"authorization": f"Bearer {secret}"}, timeout=30) as on_b,
    ):
        pool = {"model": "new/pool", "upstreams": [{"base_url": replicas["upstreams"][1], "model": "m"}], "capacity": 3}
        r = await admin.put("/admin/pools/new/pool", json=pool)
        assert r.status_code == 200 and r.json()["source"] == "store", r.text
        assert r.json()["queue"] is None or r.json()["queue"]["capacity"] == 3
        deadline = time.monotonic() + 5
        while (await on_b.post("/v1/completions", json={"model": "new/pool", "prompt": PROMPT})).status_code != 200:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        listed = (await admin.get("/admin/pools")).json()["data"]
        assert {p["model"]: p["source"] for p in listed} == {"m": "config", "other": "config", "new/pool": "store"}
        assert (await admin.delete("/admin/pools/new/pool")).status_code == 200
        assert (await admin.get("/admin/pools/new/pool")).status_code == 404
        # a config-file pool can be removed too (a stored tombstone outranks the seed) and put back
        assert (await admin.delete("/admin/pools/other")).status_code == 200
        assert "other" not in {p["model"] for p in (await admin.get("/admin/pools")).json()["data"]}


async def test_the_admin_api_refuses_what_would_break_the_table(replicas):
    a = replicas["urls"][0]
    async with httpx.AsyncClient(base_url=a, headers=replicas["admin"], timeout=30) as admin:
        alias = {"model": "chat", "variants": [{"pool": "nope", "weight": 1}]}
        r = await admin.put("/admin/aliases/chat", json=alias)
        assert r.status_code == 409 and r.json()["error"]["code"] == "routing_conflict", r.text
        assert "nope" in r.json()["error"]["message"]
        alias["variants"] = [{"pool": "other", "weight": 1}]
        assert (await admin.put("/admin/aliases/chat", json=alias)).status_code == 200
        r = await admin.delete("/admin/pools/other")  # the alias still points at it
        assert r.status_code == 409 and r.json()["error"]["code"] == "routing_conflict", r.text
        r = await admin.put("/admin/pools/x", json={"model": "x", "fallbacks": ["missing"]})
        assert r.status_code == 409 and "missing" in r.json()["error"]["message"]
        r = await admin.put(
            "/admin/pools/x", json={"model": "x", "upstreams": [{"base_url": "http://h:1", "api_key": "k"}]}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "api_key"
        r = await admin.put("/admin/pools/x", json={"model": "x", "capacity": 0})
        assert r.status_code == 400 and "capacity" in r.json()["error"]["message"]
        r = await admin.put("/admin/pools/x", json={"model": "x", "bogus": 1})
        assert r.status_code == 400, r.text
        r = await admin.put("/admin/pools/x", json={"model": "y"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = await admin.patch("/admin/pools/m/members/ghost", json={"draining": True})
        assert r.status_code == 404 and r.json()["error"]["code"] == "member_not_found"
        r = await admin.post("/admin/pools/ghost/members", json={"base_url": "http://h:1"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "pool_not_found"
        r = await admin.post("/admin/pools/m/members", json={"base_url": "http://h:1", "name": "u0"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "duplicate_member"
        assert (await admin.get("/admin/aliases/ghost")).status_code == 404


async def test_racing_admin_writes_on_two_replicas_sharing_one_sqlite_file_wait_for_the_lock(replicas):
    team_id, _ = team(replicas)
    clients = [httpx.AsyncClient(base_url=url, headers=replicas["admin"], timeout=30) for url in replicas["urls"]]
    try:
        limits = [clients[i % 2].put(f"/admin/teams/{team_id}/limits", json={"rpm": i + 1}) for i in range(40)]
        pools = [
            clients[i % 2].put("/admin/pools/other", json={"model": "other", "capacity": i + 1}) for i in range(10)
        ]
        answers = await asyncio.gather(*limits, *pools)
    finally:
        for c in clients:
            await c.aclose()
    assert Counter(r.status_code for r in answers) == {200: 50}, [r.text for r in answers if r.status_code != 200]
