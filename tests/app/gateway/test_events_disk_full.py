"""The event log's disk fills up under a running gateway (a tmpfs of the test's own: tests/support/small_disk.py): no
answer goes out unbilled, new requests are refused 503 events_unavailable with Retry-After while /health, /metrics and
the log say why, the gateway serves again by itself once the disk has room, and the store's usage is exactly what the
answered requests made, after the fault and after a restart that replays the files. When the store fails too, an
answer not yet sent is not given."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import httpx
import orjson

from loadtests.fake_upstream import FakeUpstream
from tests.support.metrics import gateway_metrics
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.small_disk import fill, small_disk
from tests.support.store import pg_schema_url
from tests.support.tcp_proxy import TCPProxy
from tokenweir.gateway.accounting.events import replay_after
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

MODEL = "fake-model"
PROMPT = [101, 102, 103, 104, 105, 106, 107, 108]  # token ids: 8 prompt tokens, as the upstream counts them


def body(stream: bool = False, ttft_ms: int = 0) -> dict:
    b = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": stream, "fake": {"tokens": 8, "ttft_ms": ttft_ms}}
    return b | ({"stream_options": {"include_usage": True}} if stream else {})


async def ask(client: httpx.AsyncClient, url: str, auth: dict, b: dict) -> tuple[int, int, dict]:
    """(status, tokens the answer says it billed, error body or headers)."""
    if not b["stream"]:
        r = await client.post(url + "/v1/completions", json=b, headers=auth)
        if r.status_code != 200:
            return r.status_code, 0, {"error": r.json()["error"], "retry-after": r.headers.get("retry-after")}
        return 200, r.json()["usage"]["total_tokens"], {}
    async with client.stream("POST", url + "/v1/completions", json=b, headers=auth) as r:
        raw = await r.aread()
    if r.status_code != 200:
        return r.status_code, 0, {"error": orjson.loads(raw)["error"]}
    data = [line[5:] for line in raw.split(b"\n") if line.startswith(b"data:")]
    chunks = [orjson.loads(d) for d in data if d.strip() != b"[DONE]"]
    return 200, sum((c.get("usage") or {}).get("total_tokens", 0) for c in chunks), {}


def send(url: str, auth: dict, bodies: list[dict], during=None) -> list[tuple[int, int, dict]]:
    async def run():
        async with httpx.AsyncClient(timeout=30) as client:
            answers = asyncio.gather(*(ask(client, url, auth, b) for b in bodies))
            if during is not None:
                await during()
            return await answers

    return asyncio.run(run())


def stored(store: Store, team_id: str) -> int:
    return sum(r.prompt_tokens + r.completion_tokens for r in store.usage(team_id=team_id))


def wait_for(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_a_full_events_disk_answers_nothing_unbilled_and_serves_again_once_it_has_room(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    team = store.create_team("t-disk-full", TeamLimits(tokens_per_day=10_000_000))
    secret, _ = store.create_key(team.id, "k")
    auth = {"authorization": f"Bearer {secret}"}
    fake = FakeUpstream(model=MODEL)
    with small_disk(tmp_path) as disk, ServerThread(fake) as upstream:
        events_path = disk / "events.jsonl"
        config = GatewayConfig(
            port=0,
            pools=[PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream.url)], capacity=64, max_queued=4096)],
            events=EventsConfig(path=str(events_path), flush_interval_s=0.05),
            usage_flush_interval_s=0.2,
        )
        answered = 0
        with serve_app(config, store=store) as gw:
            writer = gw.app.state.services.usage.writer
            before = send(gw.url, auth, [body(), body(stream=True), body()])
            assert [a[0] for a in before] == [200, 200, 200]
            answered += sum(a[1] for a in before)

            # 16 requests wait upstream while the disk fills: they end on a disk with no room for their events
            filler = None

            async def fill_disk():
                nonlocal filler
                await asyncio.sleep(0.3)
                filler = fill(disk)

            slow = [body(stream=i % 2 == 1, ttft_ms=800) for i in range(16)]
            during = send(gw.url, auth, slow, during=fill_disk)
            assert [a[0] for a in during] == [200] * 16, "their bills went to the store directly: answered"
            answered += sum(a[1] for a in during)
            assert answered == 19 * 16

            # Every answer has its bill in a durable place: its event in the file, or its row in the store
            in_file = {e["upstream_request_id"] for e in replay_after(events_path, 0) if e["status"] == "ok"}
            direct = set(store.settled_requests(writer))
            assert set(fake.records) <= in_file | direct and direct, (len(fake.records), len(in_file), len(direct))

            refused = send(gw.url, auth, [body(), body(stream=True)])
            for status, _, err in refused:
                assert status == 503 and err["error"]["code"] == "events_unavailable", err
            assert int(refused[0][2]["retry-after"]) >= 1
            health = httpx.get(gw.url + "/health", timeout=10)
            assert health.status_code == 503 and health.json()["checks"]["events"] == "down", health.text
            assert health.json()["events"]["error"].startswith("ENOSPC"), health.text
            metrics = gateway_metrics(gw.url)
            assert metrics[("tokenweir_gateway_events_writable", ())] == 0
            assert metrics[("tokenweir_gateway_event_write_failures_total", (("error", "ENOSPC"),))] >= 1
            assert metrics[("tokenweir_gateway_direct_bills_total", (("result", "stored"),))] == len(direct)
            assert metrics[("tokenweir_gateway_rejections_total", (("reason", "events_unavailable"),))] == 2
            assert len(fake.records) == 19, "the refused never reached the upstream"

            assert filler is not None
            filler.unlink()
            assert wait_for(lambda: httpx.get(gw.url + "/health", timeout=10).status_code == 200, 5), "by itself"
            again = send(gw.url, auth, [body(), body(stream=True)])
            assert [a[0] for a in again] == [200, 200]
            answered += sum(a[1] for a in again)
            assert gateway_metrics(gw.url)[("tokenweir_gateway_events_writable", ())] == 1
            assert wait_for(lambda: stored(store, team.id) == answered), (stored(store, team.id), answered)
            assert sum(fake.totals()) == answered
        # A restart replays the events after the watermark and recovers the journal's unfinished entries (the
        # requests whose "done" found no room): none is billed twice
        with serve_app(config, store=store) as gw:
            assert send(gw.url, auth, [body()])[0][0] == 200
            answered += 16
            assert wait_for(lambda: stored(store, team.id) == answered), (stored(store, team.id), answered)
            time.sleep(0.5)
            assert stored(store, team.id) == answered
        assert store.settled_requests(writer) == {}, "start-up dropped the rows no start-up needs"
    store.close()


def test_an_answer_whose_bill_reaches_neither_the_log_nor_the_store_is_refused_and_its_usage_kept(tmp_path):
    """The disk fills and the store (PostgreSQL, behind a proxy that cuts it) goes away while two requests wait
    upstream: the JSON answer is refused 503 events_unavailable, the stream was already sent; both bills stay in
    memory and reach the store once it is back (the upstream made them: the reservation's bill is kept)."""
    with pg_schema_url() as url, TCPProxy(urlsplit(url).port or 5432, urlsplit(url).hostname or "127.0.0.1") as pg:
        store = Store.open(url.replace(urlsplit(url).netloc.split("@")[-1], f"127.0.0.1:{pg.port}"))
        team = store.create_team("t-disk-and-store", TeamLimits(tokens_per_day=10_000_000))
        secret, _ = store.create_key(team.id, "k")
        auth = {"authorization": f"Bearer {secret}"}
        fake = FakeUpstream(model=MODEL)
        with small_disk(tmp_path) as disk, ServerThread(fake) as upstream:
            config = GatewayConfig(
                port=0,
                pools=[PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream.url)])],
                events=EventsConfig(path=str(disk / "events.jsonl"), flush_interval_s=0.05),
                usage_flush_interval_s=0.2,
            )
            with serve_app(config, store=store) as gw:
                assert send(gw.url, auth, [body()])[0][0] == 200
                filler = []

                async def both_fail():
                    await asyncio.sleep(0.3)
                    filler.append(fill(disk))
                    async with httpx.AsyncClient(timeout=10) as client:
                        for _ in range(20):  # other requests' events take what the file's last page still held
                            unknown = await ask(client, gw.url, auth, body() | {"model": "no-such-model"})
                            if unknown[2]["error"]["code"] == "events_unavailable":
                                break
                    await asyncio.to_thread(pg.cut)

                (json_status, _, err), (stream_status, stream_tokens, _) = send(
                    gw.url, auth, [body(ttft_ms=1500), body(stream=True, ttft_ms=1500)], during=both_fail
                )
                assert json_status == 503 and err["error"]["code"] == "events_unavailable", err
                assert "answer is not given" in err["error"]["message"] and int(err["retry-after"]) >= 1
                assert stream_status == 200 and stream_tokens == 16, "a stream's answer is out before its end"
                metrics = gateway_metrics(gw.url)
                assert metrics[("tokenweir_gateway_direct_bills_total", (("result", "failed"),))] == 2

                pg.restore()
                filler[0].unlink()
                made = sum(fake.totals())
                assert made == 3 * 16
                assert wait_for(lambda: stored(store, team.id) == made), (stored(store, team.id), made)
        store.close()
