"""A 200 that is no answer is the hop's failure, not a good answer relayed and billed: a JSON body without `choices`
(or not an object), a stream that reaches [DONE] without a choice. The next hop (here a fallback pool) answers the
client, and nothing of the broken answer is billed; with no other hop, the client gets the usual 503. A stream with an
error event after its first token is relayed as it came, and ends as one that broke off (error, upstream_broken),
whatever followed: a failure of its variant for a rollout."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.stack import events_of, team
from tokenweir.gateway.config import BreakerConfig, EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store

FRAME = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
USAGE = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else orjson.dumps(e)) + b"\n\n" for e in events)


BROKEN = {  # case -> (content type, body): each a 200
    "no-choices": ("application/json", orjson.dumps({**FRAME, "usage": USAGE})),
    "empty-choices": ("application/json", orjson.dumps({**FRAME, "choices": [], "usage": USAGE})),
    "not-an-object": ("application/json", b"[1, 2, 3]"),
    "stream-without-a-choice": ("text/event-stream", sse({**FRAME, "choices": [], "usage": USAGE}, b"[DONE]")),
}
TOKEN = {**FRAME, "choices": [{"index": 0, "text": "tok ", "finish_reason": None}]}
ERROR = {"error": {"message": "the model fell over", "type": "server_error", "param": None, "code": None}}
ERROR_MID_STREAM = sse(TOKEN, TOKEN, ERROR, b"[DONE]")


async def broken(scope, receive, send) -> None:
    """An upstream answering each completion 200 with the broken body its `fake.case` names."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] != "/v1/completions":
        await send({"type": "http.response.start", "status": 404, "headers": []})
        return await send({"type": "http.response.body", "body": b""})
    case = orjson.loads(body)["fake"]["case"]
    kind, payload = BROKEN.get(case, ("text/event-stream", ERROR_MID_STREAM))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind.encode())]})
    await send({"type": "http.response.body", "body": payload})


@pytest.fixture
def gateway(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    with ServerThread(broken) as bad, ServerThread(FakeUpstream(model="m")) as good:
        config = GatewayConfig(
            port=0,
            pools=[
                PoolConfig("m", [UpstreamConfig(bad.url, name="bad")], fallbacks=["good"]),
                PoolConfig("alone", [UpstreamConfig(bad.url, name="bad")]),
                PoolConfig("good", [UpstreamConfig(good.url, name="good", model="m")]),
            ],
            breaker=BreakerConfig(failures=1000),  # every case reaches the broken upstream
            events=EventsConfig(path=str(tmp_path / "events.jsonl"), flush_interval_s=0.05),
        )
        with serve_app(config, store=store) as server:
            yield {"store": store, "events": tmp_path / "events.jsonl", "url": server.url}
    store.close()


def ask(stack, secret: str, model: str, case: str) -> httpx.Response:
    body = {"model": model, "prompt": "a b c", "max_tokens": 5, "stream": case.startswith("stream")}
    headers = {"authorization": f"Bearer {secret}"}
    return httpx.post(stack["url"] + "/v1/completions", json=body | {"fake": {"case": case}}, headers=headers)


@pytest.mark.parametrize("case", sorted(BROKEN))
async def test_a_200_that_is_no_answer_fails_the_hop_and_the_next_one_answers(gateway, case):
    team_id, secret = team(gateway)
    r = await asyncio.to_thread(ask, gateway, secret, "m", case)
    assert r.status_code == 200, r.text
    if case.startswith("stream"):
        assert b'"text":"tok ' in r.content and b"[DONE]" in r.content, r.content
    else:
        assert r.json()["choices"][0]["text"].startswith("tok"), r.text
    (event,) = await asyncio.to_thread(events_of, gateway, team_id, 1)
    assert (event["status"], event["route"]) == ("ok", ["m@bad", "good@good"]), event
    assert event["completion_tokens"] != USAGE["completion_tokens"]  # the good hop's, not the broken one's

    r = await asyncio.to_thread(ask, gateway, secret, "alone", case)  # no other hop
    assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
    (_, event) = await asyncio.to_thread(events_of, gateway, team_id, 2)
    assert (event["status"], event["reason"], event["completion_tokens"]) == ("error", "upstream_unavailable", 0)


async def test_an_error_event_after_the_first_token_ends_the_stream_as_broken_off(gateway):
    team_id, secret = team(gateway)
    r = await asyncio.to_thread(ask, gateway, secret, "m", "stream-error-mid-way")
    assert r.status_code == 200
    events = [line for line in r.content.split(b"\n\n") if line]
    assert b"the model fell over" in events[2] and events[3:] == [b"data: [DONE]"], events  # relayed as it came
    (event,) = await asyncio.to_thread(events_of, gateway, team_id, 1)
    assert (event["status"], event["reason"], event["http_status"]) == ("error", "upstream_broken", 502), event
    assert event["usage_source"] == "estimate_text", event  # no usage came: billed as relayed, not as cut off
