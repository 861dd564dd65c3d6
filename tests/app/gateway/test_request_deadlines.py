"""A request's TTFT and total limits are its own budgets, through real HTTP: client -> gateway -> upstreams that each
hang a while before their first token, then fail. Retries and fallback hops spend what the hops before them left; none
of them starts a new budget. So a stream with a 2 s TTFT limit gets its 504 at about 2 s, however many hops its plan
and its retries hold (before: 2 s per hop, or a 503 once every hop had failed within its own fresh 2 s)."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest

from tests.support.events import the_event
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.stack import team
from tokenweir.gateway.config import (
    BreakerConfig,
    EventsConfig,
    GatewayConfig,
    PoolConfig,
    TimeoutConfig,
    UpstreamConfig,
)
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store

HANG_S = 0.8  # each hop's wait before it fails: two fit in a 2 s budget, a third does not
LIMIT_S = 2.0


class HangThenFail:
    """An upstream whose every completion waits HANG_S, then answers 503 (no byte of an answer before): a hop that
    fails before its first token, as late as it may without being the one the deadline cuts."""

    def __init__(self) -> None:
        self.seen = 0

    async def __call__(self, scope, receive, send) -> None:
        while (await receive()).get("more_body"):
            pass
        status, body = 200, b"{}"
        if scope["method"] == "POST":
            self.seen += 1
            await asyncio.sleep(HANG_S)
            status, body = 503, orjson.dumps({"error": {"message": "overloaded", "type": "server_error"}})
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deadlines")
    store = Store.open(f"sqlite:///{tmp}/store.db")
    primary, backup = HangThenFail(), HangThenFail()
    with ServerThread(primary, lifespan="off") as p, ServerThread(backup, lifespan="off") as b:

        def pool(model: str, url: str, **kw) -> PoolConfig:
            return PoolConfig(
                model, [UpstreamConfig(url, model="m", engine=False)], retries=3, retry_backoff_s=0.05, **kw
            )

        pools = [
            pool("ttft", p.url, ttft_timeout_s=LIMIT_S, fallbacks=["ttft-backup"]),
            pool("ttft-backup", b.url),
            pool("total", p.url, total_timeout_s=LIMIT_S, fallbacks=["total-backup"]),
            pool("total-backup", b.url),
        ]  # fmt: skip
        config = GatewayConfig(
            port=0,
            pools=pools,
            breaker=BreakerConfig(failures=1000),  # the hops here must not open a circuit
            timeouts=TimeoutConfig(ttft_s=60, total_s=60),
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
        )
        with serve_app(config, store=store, state_backend=InMemoryState()) as gw:
            yield {"store": store, "url": gw.url, "events": tmp / "events.jsonl", "fakes": (primary, backup)}
    store.close()


def post(stack, model: str, stream: bool) -> tuple[httpx.Response, float]:
    _, secret = team(stack)
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}
    started = time.monotonic()
    r = httpx.post(
        stack["url"] + "/v1/completions", json=body, headers={"authorization": f"Bearer {secret}"}, timeout=30
    )
    return r, time.monotonic() - started


def test_a_streams_ttft_limit_is_spent_by_its_retries_and_fallbacks_not_restarted_by_each(stack):
    r, took = post(stack, "ttft", stream=True)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    assert f"within {LIMIT_S:g}s" in r.json()["error"]["message"]
    assert LIMIT_S - 0.1 <= took < LIMIT_S + 1.0, f"the 504 came after {took:.1f}s"
    event = the_event(stack["events"], r.headers["x-request-id"])
    assert (event["status"], event["reason"]) == ("timeout", "ttft_timeout"), event
    # the primary, its fallback (both failed after HANG_S), then the retry the deadline cut
    assert event["route"] == ["ttft@ttft-0", "ttft-backup@ttft-backup-0", "ttft@ttft-0"], event


@pytest.mark.parametrize("stream", [False, True])
def test_the_total_limit_is_spent_by_retries_and_fallbacks_too(stack, stream):
    r, took = post(stack, "total", stream=stream)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    assert LIMIT_S - 0.1 <= took < LIMIT_S + 1.0, f"the 504 came after {took:.1f}s"
    event = the_event(stack["events"], r.headers["x-request-id"])
    assert (event["status"], event["reason"]) == ("timeout", "total_timeout"), event
    assert len(event["route"]) == 3, event
