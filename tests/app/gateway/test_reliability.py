"""Degraded mode, probes, durable usage and counting what is forwarded: the gateway's answers when a part fails."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import orjson
import pytest

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.support.serve_thread import ServerThread, serve_app
from tokenweir.gateway.accounting.events import EventWriter, read_events, replay_after
from tokenweir.gateway.accounting.usage import UsageRecorder
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, StateConfig, UpstreamConfig
from tokenweir.gateway.startup import replay_usage
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def dead_redis_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there: every call is refused


def gateway(tmp_path, upstream_url: str, **kwargs) -> GatewayConfig:
    pool_kwargs = kwargs.pop("pool", {})
    return GatewayConfig(
        port=0,
        pools=[PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream_url, **pool_kwargs)])],
        events=EventsConfig(path=str(tmp_path / "events.jsonl")),
        usage_flush_interval_s=0.1,
        **kwargs,
    )


def make_team(store: Store, limits: TeamLimits = TeamLimits()) -> tuple[str, dict]:
    team = store.create_team(f"t-{time.monotonic_ns()}", limits)
    secret, _ = store.create_key(team.id, "k")
    return team.id, {"authorization": f"Bearer {secret}"}


def test_unreachable_state_is_a_503_with_retry_after_and_health_names_it(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/s.db")
    _, auth = make_team(store)
    cfg = gateway(tmp_path, "http://127.0.0.1:9", state_url=dead_redis_url(), state=StateConfig(timeout_s=0.2))
    with serve_app(cfg, store=store) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=auth, timeout=10)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert (err["code"], err["type"]) == ("state_unavailable", "service_unavailable")
        assert int(r.headers["retry-after"]) >= 1
        health = httpx.get(gw.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["checks"]["state"] == "down", health.text
        assert health.json()["checks"]["store"] == "ok"
        assert httpx.get(gw.url + "/livez").status_code == 200
        assert httpx.get(gw.url + "/metrics").status_code == 200, "a scrape must not fail while Redis is away"
    (event,) = read_events(tmp_path / "events.jsonl")
    assert (event["status"], event["reason"], event["http_status"]) == ("rejected", "state_unavailable", 503)
    store.close()


def test_fail_open_admits_under_local_limits_and_keeps_the_spend_for_the_shared_state(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/s.db")
    team_id, auth = make_team(store, TeamLimits(max_concurrency=2))
    fake = FakeUpstream(model=MODEL)
    with ServerThread(fake) as up:
        state = StateConfig(on_unavailable="fail_open", timeout_s=0.2)
        with serve_app(gateway(tmp_path, up.url, state_url=dead_redis_url(), state=state), store=store) as gw:
            for _ in range(3):
                r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=auth, timeout=10)
                assert r.status_code == 200, r.text
            health = httpx.get(gw.url + "/health", timeout=10).json()
            assert health["status"] == "degraded" and health["checks"]["state"] == "down"
            pending = list(gw.app.state.services.outbox._pending.values())
            spend = [op for op in pending if op["res_id"].startswith("local-")]
            assert len(spend) == 3, "each request's spend waits for the shared state"
            assert sum(op["tokens"] for op in spend) == sum(fake.totals())
            # Redis was never reached (start-up waits for its epoch): no reserve went out, so none is to be undone
            # (a reserve whose answer was lost is: tests/app/gateway/test_state_loss.py)
            assert [op for op in pending if op not in spend] == []
            local = gw.call(gw.app.state.services.path.local.snapshot(team_id))
            assert local["in_flight"] == 0 and local["spent_today"] == sum(fake.totals())
    outbox_file = tmp_path / "events.outbox.jsonl"
    assert len(outbox_file.read_bytes().splitlines()) == 3, "undelivered changes stay on disk for the next start"
    store.close()


def test_engine_pools_refuse_non_text_parts_and_external_pools_reserve_a_bound_for_them(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/s.db")
    fake = FakeUpstream(model=MODEL)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]}
    with ServerThread(fake) as up:
        with serve_app(gateway(tmp_path, up.url), store=store) as gw:  # engine: true, the default
            _, auth = make_team(store)
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=auth, timeout=10)
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content", r.text
            assert r.json()["error"]["param"] == "messages.0.content.1"
        ext = gateway(tmp_path, up.url, pool={"engine": False})
        ext.pools[0].non_text_part_tokens = 1000
        with serve_app(ext, store=store) as gw:
            # 1000 for the image + 4 max_tokens + a few for the text: over a 1000-token day, under 1100
            _, small = make_team(store, TeamLimits(tokens_per_day=1000))
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=small, timeout=10)
            assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exhausted", r.text
            _, enough = make_team(store, TeamLimits(tokens_per_day=1100))
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=enough, timeout=10)
            assert r.status_code == 200, r.text
    store.close()


def test_metrics_need_the_token_when_one_is_set(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/s.db")
    with serve_app(gateway(tmp_path, "http://127.0.0.1:9", metrics_token="s3cret"), store=store) as gw:
        r = httpx.get(gw.url + "/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_metrics_token"
        assert httpx.get(gw.url + "/metrics", headers={"authorization": "Bearer nope"}).status_code == 401
        ok = httpx.get(gw.url + "/metrics", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and "tokenweir_gateway_requests" in ok.text
    store.close()


def test_a_client_gone_while_its_body_is_read_is_one_cancelled_event_not_a_500(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/s.db")
    _, auth = make_team(store)
    with serve_app(gateway(tmp_path, "http://127.0.0.1:9"), store=store) as gw:
        with socket.create_connection(("127.0.0.1", gw.port)) as s:
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {auth['authorization']}\r\n"
                "content-type: application/json\r\ncontent-length: 5000\r\nx-request-id: leaves-early\r\n\r\n"
            )
            s.sendall(head.encode() + b'{"model": "m", "mess')
            time.sleep(0.3)
        deadline = time.monotonic() + 5
        while not read_events(tmp_path / "events.jsonl") and time.monotonic() < deadline:
            time.sleep(0.05)
    (event,) = read_events(tmp_path / "events.jsonl")
    assert event["request_id"] == "leaves-early"
    assert (event["status"], event["reason"], event["http_status"]) == ("cancelled", "client_disconnected", 499)
    assert event["client_disconnected"] is True
    store.close()


def test_a_huge_model_string_is_clipped_in_the_event(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/s.db")
    _, auth = make_team(store)
    with serve_app(gateway(tmp_path, "http://127.0.0.1:9"), store=store) as gw:
        body = {**CHAT, "model": "x" * 100_000}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=auth, timeout=10)
        assert r.status_code in (400, 404), r.text
    (event,) = read_events(tmp_path / "events.jsonl")
    assert len(event["model"]) < 300 and event["reason"] in ("model_not_found", "invalid_value")
    store.close()


async def test_events_after_the_watermark_are_replayed_into_usage_once(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/s.db")
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path, max_bytes=600, backups=3)  # small files: the replay must cross rotations
    writer.open()
    served = {"route": ["m@a"], "team": "t", "model": "m", "served_model": "m", "prompt_tokens": 3}
    seqs = [writer.emit({**served, "completion_tokens": i}) for i in range(1, 7)]
    writer.emit({"team": "t", "model": "m", "status": "rejected"})  # never served: no usage
    await writer.close()
    assert seqs == list(range(1, 7)) and (tmp_path / "events.jsonl.1").exists()
    recorder = UsageRecorder(store, writer="w")
    store.record_usage([], watermark=("w", 4))  # a flush had stored usage up to event 4 before the crash
    assert [e["seq"] for e in replay_after(path, 4, 3)] == [5, 6, 7]
    config = GatewayConfig(events=EventsConfig(path=str(path), backups=3))
    again = EventWriter(path, max_bytes=600, backups=3)
    await replay_usage(store, recorder, again, config)
    (row,) = store.usage()
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (2, 6, 5 + 6)
    assert store.usage_watermark("w") == 7 and again.seq == 7, "seqs go on after the replayed ones"
    await replay_usage(store, UsageRecorder(store, writer="w"), EventWriter(path, backups=3), config)
    assert store.usage()[0].requests == 2, "a second start replays nothing twice"
    store.close()


def test_event_lines_are_on_disk_as_soon_as_they_are_emitted(tmp_path):
    writer = EventWriter(tmp_path / "e.jsonl", flush_interval_s=3600)
    writer.open()
    writer.emit({"request_id": "r1"})
    lines = (tmp_path / "e.jsonl").read_bytes().splitlines()  # no flush, no close: a SIGKILL now loses nothing
    assert orjson.loads(lines[0])["request_id"] == "r1" and orjson.loads(lines[0])["seq"] == 1
    asyncio.run(writer.close())


@pytest.mark.parametrize("on_unavailable", ["fail_closed", "fail_open"])
def test_state_config_is_checked(on_unavailable):
    assert StateConfig(on_unavailable=on_unavailable).on_unavailable == on_unavailable
    with pytest.raises(ValueError, match="fail_closed or fail_open"):
        StateConfig(on_unavailable="open")


def test_an_event_that_cannot_be_written_still_bills_the_request(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/s.db")
    team_id, auth = make_team(store)
    fake = FakeUpstream(model=MODEL)
    with ServerThread(fake) as up, serve_app(gateway(tmp_path, up.url), store=store) as gw:
        events = gw.app.state.services.events

        def disk_full(event: dict) -> int:
            raise OSError(28, "No space left on device")

        events.emit = disk_full
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=auth, timeout=10)
        assert r.status_code == 200, r.text
    (row,) = store.usage(team_id=team_id)
    assert row.requests == 1 and row.prompt_tokens + row.completion_tokens == sum(fake.totals())
    store.close()
