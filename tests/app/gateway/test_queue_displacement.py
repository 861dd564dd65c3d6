"""A full queue makes room for a higher band: through the real gateway (fake upstream with slow answers filling a
pool of 2 slots and 10 queue places), on both state backends (InMemoryState, and RedisState on the real Redis,
which holds the reservations and slots a displaced request must give back).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.state import URL, drop_redis_prefix, fresh_redis_prefix
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.request.queue import DispatchQueue, Ticket
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.state.redis import RedisState
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import PRIORITY_BATCH, PRIORITY_CRITICAL, PRIORITY_STANDARD, TeamLimits

MODEL = "m"
CAPACITY, MAX_QUEUED = 2, 10
PROMPT = [101, 102, 103, 104, 105, 106]  # token ids: the gateway's count and the upstream's agree exactly


@dataclass
class GatedUpstream(FakeUpstream):
    """The fake upstream, where a request sent with "fake": {"gate": true} answers only once `gate` is set: the
    pool's slots stay taken for as long as the test needs, however slow this machine is."""

    gate: threading.Event = field(default_factory=threading.Event)

    async def _complete(self, send, req, record, n_tokens, knobs, chat, end) -> None:
        while knobs.get("gate") and not self.gate.is_set():
            await asyncio.sleep(0.005)
        await super()._complete(send, req, record, n_tokens, knobs, chat, end)


@pytest.fixture(params=["memory", "redis"])
def stack(request, tmp_path):
    prefix = fresh_redis_prefix() if request.param == "redis" else None
    state = InMemoryState() if prefix is None else RedisState(URL, prefix=prefix)
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    admin_secret, _ = store.create_key(None, "admin", is_admin=True)
    fake = GatedUpstream(model=MODEL)
    with ServerThread(fake) as upstream:
        pool = PoolConfig(
            model=MODEL, upstreams=[UpstreamConfig(upstream.url)], capacity=CAPACITY, max_queued=MAX_QUEUED
        )
        config = GatewayConfig(
            port=0,
            pools=[pool],
            events=EventsConfig(path=str(tmp_path / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
        )
        with serve_app(config, store=store, state_backend=state) as gw:
            yield {
                "url": gw.url,
                "fake": fake,
                "store": store,
                "queue": gw.app.state.services.queues[MODEL],
                "events": tmp_path / "events.jsonl",
                "admin": {"authorization": f"Bearer {admin_secret}"},
            }
            fake.gate.set()  # a test that failed midway leaves no request held for the shutdown to wait on
    store.close()
    if prefix is not None:
        drop_redis_prefix(prefix)


def make_team(stack, priority: int) -> tuple[str, dict]:
    # no concurrency cap: only the pool's queue bounds this team; a day budget so every reservation shows
    team = stack["store"].create_team(
        f"team-{uuid.uuid4().hex[:10]}", TeamLimits(priority=priority, tokens_per_day=10**6)
    )
    secret, _ = stack["store"].create_key(team.id, "k")
    return team.id, {"authorization": f"Bearer {secret}"}


async def post(client: httpx.AsyncClient, auth: dict, request_id: str, gate: bool = False) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "fake": {"gate": gate}}
    headers = {**auth, "x-request-id": request_id}
    return await client.post("/v1/completions", json=body, headers=headers)


async def until(check, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def live_state(client: httpx.AsyncClient, stack, team_id: str) -> dict:
    r = await client.get(f"/admin/teams/{team_id}/state", headers=stack["admin"])
    assert r.status_code == 200, r.text
    return r.json()["live"]


def record_grants(queue: DispatchQueue) -> list[Ticket]:
    """Every ticket the queue hands out, kept as it is granted (its `granted_at` orders them)."""
    grants: list[Ticket] = []
    acquire = queue.acquire

    async def recording_acquire(*args, **kwargs) -> Ticket:
        ticket = await acquire(*args, **kwargs)
        grants.append(ticket)
        return ticket

    queue.acquire = recording_acquire  # type: ignore[method-assign]
    return grants


async def fill_pool(client, stack, auth: dict, tag: str) -> tuple[list[asyncio.Task], list[asyncio.Task]]:
    """Both slots held until the upstream's gate opens, then the whole queue, one arrival at a time (arrival order
    = list order)."""
    queue = stack["queue"]
    holders = [asyncio.ensure_future(post(client, auth, f"{tag}-hold{i}", gate=True)) for i in range(CAPACITY)]
    await until(lambda: queue.stats()["in_use"] == CAPACITY, "the pool's slots to be taken")
    queued = []
    for i in range(MAX_QUEUED):
        queued.append(asyncio.ensure_future(post(client, auth, f"{tag}-q{i}")))
        await until(lambda n=i + 1: queue.stats()["queued"] == n, f"queued request {i}")
    return holders, queued


async def test_a_critical_request_displaces_the_latest_batch_waiter_from_a_full_queue(stack):
    batch_team, batch = make_team(stack, PRIORITY_BATCH)
    crit_team, crit = make_team(stack, PRIORITY_CRITICAL)
    grants = record_grants(stack["queue"])
    async with httpx.AsyncClient(base_url=stack["url"], timeout=30) as client:
        holders, queued = await fill_pool(client, stack, batch, "batch")
        before = await live_state(client, stack, batch_team)
        assert (before["in_flight"], before["open_reservations"]) == (12, 12)

        critical = asyncio.ensure_future(post(client, crit, "crit"))
        await asyncio.wait([critical, queued[-1]], timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert not critical.done(), f"the critical request was answered at once: {critical.result().text}"
        displaced = queued[-1].result()  # the latest arrival of the lowest band
        assert displaced.status_code == 429, displaced.text
        err = displaced.json()["error"]
        assert err["code"] == "displaced" and err["type"] and "priority 0" in err["message"], err
        assert int(displaced.headers["retry-after"]) >= 1
        after = await live_state(client, stack, batch_team)  # its event is written before its answer is sent
        assert (after["in_flight"], after["open_reservations"]) == (11, 11), "its slot and reservation are back"
        assert after["reserved_tokens"] == before["reserved_tokens"] * 11 // 12
        assert not critical.done(), "it waits for a slot like any queued request"

        stack["fake"].gate.set()
        answer = await asyncio.wait_for(critical, 10)
        assert answer.status_code == 200, answer.text
        served = await asyncio.gather(*holders, *queued[:-1])
        assert [r.status_code for r in served] == [200] * 11
        assert stack["queue"].stats()["displaced"] == 1 and stack["queue"].stats()["rejected_full"] == 0

        ids = ["crit", "batch-q9"] + [f"batch-hold{i}" for i in range(CAPACITY)] + [f"batch-q{i}" for i in range(9)]
        await until(lambda: {e["request_id"] for e in read_events(stack["events"])} >= set(ids), "every event")
        events = read_events(stack["events"])
        assert sorted(e["request_id"] for e in events) == sorted(ids), "one event per request"
        shed = next(e for e in events if e["request_id"] == "batch-q9")
        assert (shed["status"], shed["reason"], shed["http_status"]) == ("rejected", "displaced", 429)
        assert shed["prompt_tokens"] == shed["completion_tokens"] == 0
        # the critical request was granted the next slot, before the 9 batch waiters queued ahead of it, who kept
        # their arrival order (the queue's grants; upstream arrival may swap two requests granted a moment apart)
        granted = sorted(grants, key=lambda t: t.granted_at)[CAPACITY:]
        assert [t.team_id for t in granted] == [crit_team] + [batch_team] * 9, granted
        assert [t.id for t in granted[1:]] == sorted(t.id for t in granted[1:]), "batch waiters out of FIFO order"
        by_upstream_id = {e["upstream_request_id"]: e["request_id"] for e in events if e["upstream_request_id"]}
        order = [by_upstream_id[uid] for uid in stack["fake"].records if uid in by_upstream_id]
        assert "crit" in order[CAPACITY : 2 * CAPACITY], order

        spent = sum(e["prompt_tokens"] + e["completion_tokens"] for e in events if e["team"] == batch_team)
        end = await live_state(client, stack, batch_team)
        assert (end["in_flight"], end["open_reservations"], end["reserved_tokens"]) == (0, 0, 0)
        assert end["day"]["reserved"] == 0 and end["spent_today"] == spent == 11 * (len(PROMPT) + 4)
        crit_end = await live_state(client, stack, crit_team)
        assert (crit_end["in_flight"], crit_end["open_reservations"]) == (0, 0)


async def test_a_request_no_higher_than_every_waiter_is_still_refused_when_the_queue_is_full(stack):
    batch_team, batch = make_team(stack, PRIORITY_STANDARD)
    _, same = make_team(stack, PRIORITY_STANDARD)
    _, lower = make_team(stack, PRIORITY_BATCH)
    async with httpx.AsyncClient(base_url=stack["url"], timeout=30) as client:
        holders, queued = await fill_pool(client, stack, batch, "std")
        for auth, rid in ((same, "same-band"), (lower, "lower-band")):
            r = await post(client, auth, rid)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            assert int(r.headers["retry-after"]) >= 1
        stack["fake"].gate.set()
        served = await asyncio.gather(*holders, *queued)
        assert [r.status_code for r in served] == [200] * (CAPACITY + MAX_QUEUED), "no waiter was displaced"
        assert stack["queue"].stats()["displaced"] == 0
        end = await live_state(client, stack, batch_team)
        assert (end["in_flight"], end["open_reservations"], end["reserved_tokens"]) == (0, 0, 0)
