"""The in-flight journal (gateway/request/inflight.py) on its own: what a dead process leaves is exactly its unfinished
requests, whatever the file's history; and a shared state's lease is released by the id the journal keeps."""

from __future__ import annotations

import asyncio
import time
import types
import uuid

from tests.support.services import require_service
from tokenweir.gateway.request.context import RequestContext
from tokenweir.gateway.request.inflight import InflightJournal, read_unfinished
from tokenweir.policies.limits import TeamLimits
from tokenweir.policies.reservation import Reservation

HOP = types.SimpleNamespace(
    instance=types.SimpleNamespace(cfg=types.SimpleNamespace(base_url="http://127.0.0.1:9", engine=True)),
    label="m@m-0",
    model="m",
)


def request(i: int) -> RequestContext:
    ctx = RequestContext(
        request_id=f"r-{i}",
        kind="chat",
        body={},
        team_id="t",
        key_id="k",
        limits=TeamLimits(),
        model="m",
        stream=True,
        t0=0.0,
        deadline_base=0.0,
        priority=0,
        prompt_tokens=10,
        max_tokens=20,
    )
    ctx.reservation = Reservation("t", 30, time.time(), "d", "m", backend_id=f"res-{i}")
    ctx.upstream_id = f"tw-{i}"
    return ctx


def test_a_dead_processs_journal_names_exactly_its_unfinished_requests(tmp_path):
    journal = InflightJournal(tmp_path / "ev.inflight.jsonl")
    journal.open()
    ctxs = [request(i) for i in range(4)]
    for ctx in ctxs:
        journal.reserved(ctx)
        journal.slot(ctx, lease_id=f"lease-{ctx.request_id}", key_id=None)
    journal.hop(ctxs[1], HOP)
    journal.done(ctxs[0])
    journal.done(ctxs[2])
    with open(journal.path, "ab") as f:
        f.write(b'{"k": "torn')  # the kill came mid-write
    left = {u.res["rid"]: u for u in read_unfinished(journal.path)}
    assert sorted(left) == ["r-1", "r-3"]
    assert left["r-1"].res["res_id"] == "res-1" and left["r-1"].res["max"] == 20
    assert left["r-1"].leases == [{"op": "release_slot", "team_id": "t", "lease_id": "lease-r-1", "key_id": None}]
    assert [(h["uid"], h["url"], h["engine"]) for h in left["r-1"].hops] == [("tw-1", "http://127.0.0.1:9", True)]
    assert left["r-3"].hops == []


def test_the_journal_stays_small_however_many_requests_pass(tmp_path):
    journal = InflightJournal(tmp_path / "ev.inflight.jsonl", max_bytes=4096)
    journal.open()
    running = request(-1)
    journal.reserved(running)
    for i in range(500):
        ctx = request(i)
        journal.reserved(ctx)
        journal.hop(ctx, HOP)
        journal.done(ctx)
    assert journal.path.stat().st_size <= 2 * 4096
    assert [u.res["rid"] for u in read_unfinished(journal.path)] == ["r--1"], "compaction kept the live request"
    assert len(journal) == 1


def test_a_request_releases_its_own_lease_by_id_not_another_ones():
    from tokenweir.gateway.state.backend import StateUnavailable
    from tokenweir.gateway.state.redis import RedisState

    state = RedisState(prefix=f"twtest-{uuid.uuid4().hex[:8]}")
    slots, redis = state.keys.key("t", "slots"), state.client

    async def run() -> None:
        try:
            await state.ping()
        except StateUnavailable as e:
            await state.close()
            require_service("redis", str(e))
        try:
            first, second = uuid.uuid4().hex, uuid.uuid4().hex
            assert await state.acquire_slot("t", 2, lease_id=first) and await state.acquire_slot(
                "t", 2, lease_id=second
            )
            assert sorted(await redis.zrange(slots, 0, -1)) == sorted([first, second]), "named as the caller said"
            await state.release_slot("t", lease_id=first)  # the older one: a plain release would drop the newest
            assert await redis.zrange(slots, 0, -1) == [second], "the lease a restart would release is the live one"
            await state.release_slot("t", lease_id=second)
            assert not await redis.zcard(slots)
            assert await state.acquire_slot("t", 1) and not await state.acquire_slot("t", 1)
        finally:
            await redis.delete(slots)
            await state.close()

    asyncio.run(run())
