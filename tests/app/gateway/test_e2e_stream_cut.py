"""A streaming upstream that goes on past the max_tokens it was sent is cut at the reservation, through real HTTP:
client -> gateway -> fake upstream told to overrun (`"overrun": true`: it ignores max_tokens).

The client gets at most max_tokens content deltas per choice, each choice ended with finish_reason "length", its
usage chunk and [DONE]; the gateway closes the upstream stream at once (the fake stops when its client goes, and
counts what it made) and stops an engine; the bill is the engine's own count, or for an external upstream what was
relayed, and the event says `reason: output_cut`. A compliant upstream is never cut.
"""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.stack import events_of, team
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.request.stream_chunks import ChunkFilter
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store

PROMPT = [101, 102, 103, 104, 105, 106]  # token ids: the gateway's count and the upstream's agree exactly
MAX_TOKENS = 5
OVERRUN = {"tokens": 200, "itl_ms": 5, "overrun": True}  # 1 s per choice if nobody stops it


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream-cut")
    store = Store.open(f"sqlite:///{tmp}/store.db")
    fake = FakeUpstream(model="fake")
    with ServerThread(fake) as upstream:
        pools = [  # the same fake, as our engine (asked for /abort) and as an external OpenAI-compatible server
            PoolConfig(model="engine", upstreams=[UpstreamConfig(upstream.url, model="fake", engine=True)]),
            PoolConfig(model="external", upstreams=[UpstreamConfig(upstream.url, model="fake", engine=False)]),
        ]
        config = GatewayConfig(
            port=0,
            pools=pools,
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
        )
        with serve_app(config, store=store, state_backend=InMemoryState()) as gw:
            yield {"store": store, "url": gw.url, "events": tmp / "events.jsonl", "fake": fake, "app": gw.app, "gw": gw}
    store.close()


def stream(stack, secret: str, path: str, body: dict) -> dict:
    """The client's view of one stream: content deltas and finish_reason per choice index, the usage chunk, [DONE]."""
    seen: dict = {"deltas": {}, "finish": {}, "usage": None, "done": False}
    headers = {"authorization": f"Bearer {secret}"}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", stack["url"] + path, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                seen["done"] = True
                continue
            chunk = orjson.loads(line[6:])
            assert "error" not in chunk, chunk
            seen["usage"] = chunk.get("usage") or seen["usage"]
            for c in chunk.get("choices") or ():
                text = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
                if text:
                    seen["deltas"][c["index"]] = seen["deltas"].get(c["index"], 0) + 1
                if c.get("finish_reason"):
                    seen["finish"][c["index"]] = c["finish_reason"]
    return seen


@pytest.mark.parametrize(
    ("pool", "path", "n"),
    [
        ("external", "/v1/completions", 1),
        ("external", "/v1/completions", 2),
        ("external", "/v1/chat/completions", 2),
        ("engine", "/v1/completions", 1),
        ("engine", "/v1/completions", 2),
        ("engine", "/v1/chat/completions", 2),
    ],
)
def test_a_stream_past_its_max_tokens_is_cut_at_the_reservation_and_billed_what_was_made_or_relayed(
    stack, pool, path, n
):
    team_id, secret = team(stack)
    fake = stack["fake"]
    if path == "/v1/completions":
        body = {"model": pool, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "n": n, "fake": OVERRUN}
    else:
        body = {"model": pool, "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS, "n": n}
        body["fake"] = OVERRUN
    seen = stream(stack, secret, path, body)

    assert seen["done"], seen
    assert seen["deltas"] == dict.fromkeys(range(n), MAX_TOKENS), seen  # at most max_tokens each (and all of it)
    assert seen["finish"] == dict.fromkeys(range(n), "length"), seen
    [event] = events_of(stack, team_id, 1)
    record = fake.records[event["upstream_request_id"]]
    # The upstream was stopped early: it made far less than the 200 per choice it was told to, and knows it was cut
    # (at its next token, 5 ms after the gateway closed the stream).
    deadline = time.monotonic() + 2.0
    while record.status == "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert record.status in ("cancelled", "aborted"), record
    assert MAX_TOKENS * n < record.completion_tokens < 200 * n, record
    if pool == "engine":  # the engine's own count of what it made, past the bound or not
        expected = (record.prompt_tokens, record.completion_tokens, "engine_abort")
    else:  # no usage came: what was relayed, each delta one token of "tok "
        prompt = len(PROMPT) if path == "/v1/completions" else event["prompt_tokens"]
        expected = (prompt, MAX_TOKENS * n, "estimate_text")
    assert (event["prompt_tokens"], event["completion_tokens"], event["usage_source"]) == expected, event
    assert (event["status"], event["reason"], event["finish_reason"]) == ("ok", "output_cut", "length"), event
    assert (event["max_tokens"], event["overrun_tokens"]) == (MAX_TOKENS * n, expected[1] - MAX_TOKENS * n), event
    usage = seen["usage"]  # the client is told what it is billed
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == expected[:2], usage
    snap = stack["gw"].call(stack["app"].state.services.state.snapshot(team_id))
    assert snap["spent_today"] == expected[0] + expected[1], snap


@pytest.mark.parametrize("pool", ["engine", "external"])
def test_a_stream_that_keeps_to_its_max_tokens_is_never_cut(stack, pool):
    team_id, secret = team(stack)
    body = {"model": pool, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "n": 2, "fake": {"tokens": MAX_TOKENS}}
    seen = stream(stack, secret, "/v1/completions", body)
    assert seen["done"] and seen["deltas"] == {0: MAX_TOKENS, 1: MAX_TOKENS}, seen
    [event] = events_of(stack, team_id, 1)
    assert (event["reason"], event["usage_source"], event["completion_tokens"]) == (None, "upstream", 2 * MAX_TOKENS)
    assert stack["fake"].records[event["upstream_request_id"]].status == "finished"


def test_a_separate_finish_chunk_after_the_last_allowed_delta_is_not_a_cut():
    """OpenAI ends a choice with an empty delta and its finish_reason after the last content delta: at the bound,
    that chunk passes through untouched."""
    chunks = ChunkFilter(True, False, True, lambda: 0.0, per_choice=2, choices=1)
    content = b'{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"a"}}]}'
    finish = b'{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}'
    assert chunks.process(content) == b"data: " + content + b"\n\n"
    assert chunks.process(content) == b"data: " + content + b"\n\n"
    assert chunks.process(finish) == b"data: " + finish + b"\n\n"
    assert not chunks.cut and not chunks.cut_off
    # ... while a third content delta would have been the end of the choice, not content
    chunks = ChunkFilter(True, False, True, lambda: 0.0, per_choice=2, choices=1)
    for _ in range(2):
        chunks.process(content)
    ended = orjson.loads(chunks.process(content)[6:])
    assert ended["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}] and chunks.cut_off
