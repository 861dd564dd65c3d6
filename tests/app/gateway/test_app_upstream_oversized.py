"""An upstream that never ends what it sends: a stream with no SSE delimiter, a JSON body with no end. Each is read up
to its bound, not to its end: the stream ends as a broken upstream stream (billed as one), the JSON answer as a bad
body, and other tenants' requests meanwhile are served as fast as before. The upstream is a raw asyncio server on this
test's loop (tests/support/raw_upstream.py), flooding 64 MB; the gateway runs in its thread."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import orjson
import pytest

from tests.support.raw_upstream import GOOD_ANSWER, gateway_over, read_request
from tests.support.stack import events_of, team
from tokenweir.gateway.upstream import client as upstream_client
from tokenweir.gateway.upstream.sse import MAX_EVENT_BYTES

FLOOD = 64 << 20  # what the upstream would send, if it were read to the end
NEAR_THE_BOUND = 16 << 20  # the bound, plus what the socket buffers on both sides hold
FIRST_CHUNK = {
    "id": "c",
    "object": "text_completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "text": "hi"}],
}
FIRST_EVENT = b"data: " + orjson.dumps(FIRST_CHUNK) + b"\n\n"
MAX_TOKENS = 8


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FloodingUpstream:
    """Answers a completion whose body names `fake.flood` by sending 64 MB without an end it can be read to:
    "stream_after_first" (an SSE stream: one event, then a line that never ends), "stream" (that line at once),
    "json" (a chunked JSON body that never closes); any other with a small good answer. Counts what it managed to
    write before the gateway closed the socket."""

    def __init__(self) -> None:
        self.written = 0
        self.flood_ended = asyncio.Event()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            line, body = await read_request(reader)
            if not line.startswith("POST /v1/completions "):
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                continue
            flood = (json.loads(body).get("fake") or {}).get("flood")
            if flood is None:
                writer.write(GOOD_ANSWER)
                continue
            try:
                await self.flood(writer, flood)
            finally:
                self.flood_ended.set()
            return

    async def flood(self, writer: asyncio.StreamWriter, kind: str) -> None:
        media = b"application/json" if kind == "json" else b"text/event-stream"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % media)
        if kind == "stream_after_first":
            writer.write(chunk(FIRST_EVENT))
        writer.write(chunk(b'{"choices": ["' if kind == "json" else b"data: "))
        piece = chunk(b"x" * (64 << 10))
        while self.written < FLOOD:
            writer.write(piece)
            await writer.drain()  # raises once the gateway has closed the socket
            self.written += 64 << 10
        writer.write(chunk(b'"]}' if kind == "json" else b"\n\ndata: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()


@pytest.fixture
async def gateway(tmp_path):
    async with gateway_over(tmp_path, FloodingUpstream()) as stack:
        yield stack


def body(flood: str | None = None, stream: bool = False) -> dict:
    out: dict = {"model": "m", "prompt": "a b c", "max_tokens": MAX_TOKENS, "stream": stream}
    if flood is not None:
        out["fake"] = {"flood": flood}
    return out


async def latencies(http: httpx.AsyncClient, secret: str, n: int, until: asyncio.Event | None = None) -> list[float]:
    """Seconds each of at least `n` small requests took, one after the other (and on until `until` is set)."""
    out = []
    while len(out) < n or (until is not None and not until.is_set()):
        t = time.perf_counter()
        r = await http.post("/v1/completions", json=body(), headers={"authorization": f"Bearer {secret}"})
        out.append(time.perf_counter() - t)
        assert r.status_code == 200, r.text
    return out


def p99(samples: list[float]) -> float:
    return sorted(samples)[min(len(samples) - 1, int(0.99 * len(samples)))]


async def test_a_stream_without_an_sse_delimiter_ends_at_the_bound_as_a_broken_stream_billed_as_one(gateway):
    team_id, secret = team(gateway)
    other_id, other = team(gateway)
    async with httpx.AsyncClient(base_url=gateway["url"], timeout=60) as http:
        before = await latencies(http, other, 30)
        started = time.perf_counter()
        during = asyncio.create_task(latencies(http, other, 30, gateway["up"].flood_ended))
        auth = {"authorization": f"Bearer {secret}"}
        async with http.stream("POST", "/v1/completions", json=body("stream_after_first", True), headers=auth) as r:
            assert r.status_code == 200
            received = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        took = time.perf_counter() - started
        during_s = await asyncio.wait_for(during, 60)
    assert sum(len(line) for line in received) < 4096, "nothing of the endless line reached the client"
    assert len(received) == 3 and received[-1] == "data: [DONE]", received
    assert '"text":"hi"' in received[0]
    assert json.loads(received[1][6:])["error"]["code"] == "upstream_broken"
    assert gateway["up"].written < NEAR_THE_BOUND, f"read {gateway['up'].written} bytes, the bound is {MAX_EVENT_BYTES}"
    assert took < 10, f"the stream took {took:.1f}s to end"

    (event,) = await asyncio.to_thread(events_of, gateway, team_id, 1)
    assert (event["status"], event["reason"], event["http_status"]) == ("error", "upstream_broken", 502), event
    assert "SSE event" in event["upstream_error"], event
    # billed as any stream cut before its usage: at the bound its reservation held
    assert event["usage_source"] == "reservation_bound" and event["completion_tokens"] == MAX_TOKENS, event
    services = gateway["gw"].app.state.services
    snap = await asyncio.to_thread(gateway["gw"].call, services.state.snapshot(team_id))
    assert snap["reserved_tokens"] == 0 and snap["in_flight"] == 0, "nothing left reserved"
    assert snap["spent_today"] == event["prompt_tokens"] + event["completion_tokens"]

    # the other tenant's requests meanwhile: as fast as before (2x, with slack for a shared machine's noise)
    assert p99(during_s) <= max(2 * p99(before), p99(before) + 0.25), (p99(before), p99(during_s))


async def test_a_stream_that_starts_without_an_sse_delimiter_fails_its_hop_before_any_byte_is_sent(gateway):
    team_id, secret = team(gateway)
    async with httpx.AsyncClient(base_url=gateway["url"], timeout=60) as http:
        r = await http.post("/v1/completions", json=body("stream", True), headers={"authorization": f"Bearer {secret}"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
    # what went wrong, without the bound or the address: not the "connection failed" of a refused connection
    assert "m@raw: an oversized event" in r.json()["error"]["message"], r.text
    assert gateway["up"].written < NEAR_THE_BOUND
    (event,) = await asyncio.to_thread(events_of, gateway, team_id, 1)
    assert (event["status"], event["reason"]) == ("error", "upstream_unavailable"), event
    assert "SSE event" in event["upstream_error"], event


async def test_a_json_answer_over_the_body_bound_is_a_bad_body_read_no_further(gateway, monkeypatch):
    monkeypatch.setattr(upstream_client, "MAX_BODY_BYTES", 1 << 20)  # the default (64 MiB) as the flood's 1 MiB
    team_id, secret = team(gateway)
    async with httpx.AsyncClient(base_url=gateway["url"], timeout=60) as http:
        r = await http.post("/v1/completions", json=body("json"), headers={"authorization": f"Bearer {secret}"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
    assert gateway["up"].written < NEAR_THE_BOUND
    (event,) = await asyncio.to_thread(events_of, gateway, team_id, 1)
    assert "over the bound" in event["upstream_error"], event
