"""Pool members found by DNS, end to end: a DNS server on loopback answers for a name whose addresses change under
load (127.0.0.1, then 127.0.0.1 + 127.0.0.2 + 127.0.0.3, then 127.0.0.2 alone), with an engine-like fake upstream
on the first two addresses at one port and nothing on the third (a pod not ready). No request fails, each writes one
event, the new address takes requests, the one that never answered gets none, the vanished ones stop getting new
requests, drain and leave; metrics and events name each instance by its address."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.support.dns_server import LoopbackDNS
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.stack import team
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import DiscoveryConfig, EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store

NAME = "engines.tokenweir.test"
PROMPT = [101, 102, 103]


@pytest.fixture
def cluster(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    port = free_port()
    fakes = [FakeUpstream(model="m"), FakeUpstream(model="m")]
    with (
        LoopbackDNS() as dns,
        ServerThread(fakes[0], port=port, host="127.0.0.1"),
        ServerThread(fakes[1], port=port, host="127.0.0.2"),
    ):
        dns.records[NAME] = ["127.0.0.1"]
        member = UpstreamConfig(f"http://{NAME}:{port}", name="engine", model="m", discover=True)
        config = GatewayConfig(
            port=0,
            pools=[PoolConfig("m", [member], capacity=256)],
            discovery=DiscoveryConfig(interval_s=0.2, nameservers=[dns.nameserver], drain_s=1.0),
            events=EventsConfig(path=str(tmp_path / "events.jsonl"), flush_interval_s=0.05),
            load_poll_interval_s=0.2,
        )
        with serve_app(config, store=store, state_backend=InMemoryState()) as gw:
            admin, _ = store.create_key(None, "admin", is_admin=True)
            yield {
                "store": store,
                "url": gw.url,
                "dns": dns,
                "fakes": fakes,
                "admin": {"authorization": f"Bearer {admin}"},
                "events": tmp_path / "events.jsonl",
            }
    store.close()


async def test_addresses_joining_and_vanishing_under_load_never_fail_a_request(cluster):
    _, secret = team(cluster)
    dns, (first, second) = cluster["dns"], cluster["fakes"]
    stop = asyncio.Event()
    statuses: Counter = Counter()
    ids: list[str] = []

    async def client(c: httpx.AsyncClient, stream: bool) -> None:
        while not stop.is_set():
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": stream}
            body["fake"] = {"tokens": 4, "ttft_ms": 20}
            r = await c.post("/v1/completions", json=body)
            statuses[r.status_code] += 1
            ids.append(r.headers.get("x-request-id", ""))

    async def members() -> dict[str, dict]:
        pool = (await admin.get("/admin/pools/m")).json()
        return {m["name"]: m for m in pool["members"]}

    auth = {"authorization": f"Bearer {secret}"}
    admin = httpx.AsyncClient(base_url=cluster["url"], headers=cluster["admin"], timeout=30)
    clients = [httpx.AsyncClient(base_url=cluster["url"], headers=auth, timeout=30) for _ in range(8)]
    started = time.monotonic()
    load = [asyncio.create_task(client(c, stream=i % 2 == 1)) for i, c in enumerate(clients)]
    try:
        # resolved before the first request: one member, by its address; the pool's config as written
        assert list(await members()) == ["engine-127.0.0.1"]
        (declared,) = (await admin.get("/admin/pools/m")).json()["config"]["upstreams"]
        assert (declared["name"], declared["discover"]) == ("engine", True)
        await asyncio.sleep(0.8)
        assert second.requests_seen == 0
        dns.records[NAME] = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]  # a pod joins, and one not ready yet
        deadline = time.monotonic() + 5
        while second.requests_seen < 20:
            assert time.monotonic() < deadline, "the new address took no requests within 5 s"
            await asyncio.sleep(0.05)
        joined = await members()
        assert set(joined) == {"engine-127.0.0.1", "engine-127.0.0.2", "engine-127.0.0.3"}
        assert joined["engine-127.0.0.2"]["base_url"] == f"http://127.0.0.2:{cluster_port(joined)}"
        circuits = {name: m["circuit"] for name, m in joined.items()}
        assert circuits == {"engine-127.0.0.1": "closed", "engine-127.0.0.2": "closed", "engine-127.0.0.3": "down"}
        await asyncio.sleep(0.5)
        dns.records[NAME] = ["127.0.0.2"]  # a pod goes
        deadline = time.monotonic() + 5
        while not (await members()).get("engine-127.0.0.1", {}).get("draining"):
            assert time.monotonic() < deadline, "the vanished address did not drain within 5 s"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # what it had in flight (20 ms answers) finishes
        drained_at = first.requests_seen
        while set(await members()) != {"engine-127.0.0.2"}:  # the vanished ones leave after drain_s
            assert time.monotonic() < deadline, "the vanished address did not leave within 5 s"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        assert first.requests_seen == drained_at  # nothing new reached the vanished address
        dns.records.pop(NAME)  # DNS gone: the last addresses stand
        await asyncio.sleep(0.5)
        assert list(await members()) == ["engine-127.0.0.2"]
        metrics = (await admin.get("/metrics")).text
    finally:
        stop.set()
        await asyncio.gather(*load)
        for c in [admin, *clients]:
            await c.aclose()
    assert set(statuses) == {200}, statuses
    served_late = second.requests_seen
    assert served_late > 50 and first.requests_seen > 20
    assert 'upstream="engine-127.0.0.2"' in metrics
    deadline = time.monotonic() + 5
    while len(events := [e for e in read_events(cluster["events"]) if e.get("request_id") in set(ids)]) < len(ids):
        assert time.monotonic() < deadline, "events missing"
        await asyncio.sleep(0.05)
    assert sorted(e["request_id"] for e in events) == sorted(ids)  # one event per request
    assert {e["instance"] for e in events} == {"m@engine-127.0.0.1", "m@engine-127.0.0.2"}
    assert all(e["route"] == [e["instance"]] for e in events)  # no hop ever tried the address that never answered
    assert time.monotonic() - started < 15


def cluster_port(members: dict[str, dict]) -> str:
    return members["engine-127.0.0.1"]["base_url"].rpartition(":")[2]
