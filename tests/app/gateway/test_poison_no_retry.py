"""A request an engine failed as its own (a grammar it could not follow, an error inside the engine while it ran)
goes to no other engine of the pool: a poison request reaches at most one. What an engine refuses before running it
(503 engine_dead: its loop died earlier) still goes to the next instance. Two real upstream servers, one pool."""

from __future__ import annotations

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.app.gateway.test_reliability import MODEL, make_team
from tests.support.serve_thread import ServerThread, serve_app
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store

CASES = {  # the engine's answer -> what the client gets, and how many engines saw the request
    "grammar_400": (
        {"status": 400, "error": {"type": "invalid_request_error", "code": "invalid_response_format"}},
        400,
    ),
    "grammar_event": ({"error": {"type": "invalid_request_error", "code": "invalid_response_format"}}, 400),
    "request_failed": ({"status": 500, "error": {"type": "server_error", "code": "request_failed"}}, 502),
    "loop_died_event": ({"error": {"type": "server_error", "code": "engine_loop_died"}}, 502),
}


def two_engine_pool(tmp_path, urls: list[str]) -> GatewayConfig:
    return GatewayConfig(
        port=0,
        pools=[PoolConfig(model=MODEL, route="round_robin", upstreams=[UpstreamConfig(u) for u in urls])],
        events=EventsConfig(path=str(tmp_path / "events.jsonl")),
        usage_flush_interval_s=0.1,
    )


# An error status answers a JSON call and a stream alike; an error event comes only in a stream.
RUNS = [
    (case, stream)
    for case, (knobs, _) in sorted(CASES.items())
    for stream in (True, False)
    if stream or "status" in knobs
]


@pytest.mark.parametrize(("case", "stream"), RUNS)
def test_a_request_an_engine_failed_as_its_own_is_not_retried_on_the_next(tmp_path, case, stream):
    knobs, status = CASES[case]
    store = Store.open(f"sqlite:///{tmp_path}/s.db")
    _, auth = make_team(store)
    fakes = [FakeUpstream(model=MODEL), FakeUpstream(model=MODEL)]
    with (
        ServerThread(fakes[0]) as a,
        ServerThread(fakes[1]) as b,
        serve_app(two_engine_pool(tmp_path, [a.url, b.url]), store=store) as gw,
    ):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "fake": knobs}
        r = httpx.post(gw.url + "/v1/chat/completions", json={**body, "stream": stream}, headers=auth, timeout=10)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["code"] == ("invalid_response_format" if status == 400 else "upstream_request_failed")
        assert "http://" not in error["message"] and "127.0.0.1" not in error["message"]
        assert sum(f.requests_seen for f in fakes) == 1, "the request reached a second engine"
        ok = httpx.post(gw.url + "/v1/chat/completions", json={**body, "fake": {}}, headers=auth, timeout=10)
        assert ok.status_code == 200, "the pool still serves"
    (event, _) = read_events(tmp_path / "events.jsonl")
    assert event["http_status"] == status and len(event["route"]) == 1, event
    store.close()


def test_an_engine_that_refuses_as_dead_is_passed_over_for_the_next(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/s.db")
    _, auth = make_team(store)
    fakes = [FakeUpstream(model=MODEL), FakeUpstream(model=MODEL)]
    with (
        ServerThread(fakes[0]) as a,
        ServerThread(fakes[1]) as b,
        serve_app(two_engine_pool(tmp_path, [a.url, b.url]), store=store) as gw,
    ):
        fakes[0].down = True  # every request 503, as an engine whose loop died answers new ones
        for _ in range(2):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=auth, timeout=10)
            assert r.status_code == 200, r.text
        assert fakes[0].requests_seen >= 1 and fakes[1].requests_seen == 2
    store.close()
