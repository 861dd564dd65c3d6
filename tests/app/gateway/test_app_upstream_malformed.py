"""Malformed and cut upstream answers through the gateway: each ends as the gateway's usual upstream error (503
upstream_unavailable after the only instance failed, never a 500 or a hang), the request settled and its event
written, nothing left reserved; the next request gets a fresh socket and an answer. The upstream is a raw asyncio
server on this test's loop writing exact bytes (tests/support/raw_upstream.py); the gateway runs in its thread."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.support.raw_upstream import CUT, GOOD_ANSWER, INTERIM_THEN_OK, MALFORMED, gateway_over, read_request
from tests.support.stack import events_of, team

GOOD_OR_FAILED = {"body-longer-than-content-length", "204-with-a-body"}


def answers() -> dict[str, tuple[bytes, bool]]:
    """case -> (bytes to write, close after them)."""
    out = {name: (raw, False) for name, raw in MALFORMED.items()}
    out |= {name: (raw, True) for name, raw in CUT.items()}
    out["interim-then-ok"] = (INTERIM_THEN_OK.split(b"HTTP/1.1 200")[0] + GOOD_ANSWER, False)
    return out


ANSWERS = answers()


class RawUpstream:
    """Answers each completion with the bytes its body's `fake.case` names (a good answer without one), anything
    else with 404; counts connections and completions per connection."""

    def __init__(self) -> None:
        self.connections = 0
        self.completions: list[tuple[int, str | None]] = []  # (connection number, case)

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        while True:
            line, body = await read_request(reader)
            if not line.startswith("POST /v1/completions "):  # /v1/models, /abort (after a failed hop)
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                continue
            case = (json.loads(body).get("fake") or {}).get("case")
            self.completions.append((number, case))
            if case is None:
                writer.write(GOOD_ANSWER)
                continue
            raw, cut = ANSWERS[case]
            writer.write(raw)
            await writer.drain()
            if cut:
                return
            if case == "interim-then-ok":
                continue
            await reader.read()  # the gateway must close this socket, not reuse it
            return


@pytest.fixture
async def gateway(tmp_path):
    async with gateway_over(tmp_path, RawUpstream()) as stack:
        yield stack


async def complete(stack, secret: str, case: str | None) -> httpx.Response:
    body: dict = {"model": "m", "prompt": "a b c", "max_tokens": 5}
    if case is not None:
        body["fake"] = {"case": case}
    async with httpx.AsyncClient(timeout=10) as http, asyncio.timeout(10):
        return await http.post(
            stack["url"] + "/v1/completions", json=body, headers={"authorization": f"Bearer {secret}"}
        )


@pytest.mark.parametrize("case", sorted(set(MALFORMED) - GOOD_OR_FAILED) + sorted(CUT))
async def test_a_malformed_answer_is_the_usual_upstream_error_and_the_request_is_settled(gateway, case):
    team_id, secret = team(gateway)
    r = await complete(gateway, secret, case)
    assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
    (event,) = await asyncio.to_thread(events_of, gateway, team_id, 1)
    assert (event["status"], event["reason"], event["http_status"], event["route"]) == (
        "error",
        "upstream_unavailable",
        503,
        ["m@raw"],
    ), event
    assert "bad response" in event["upstream_error"] or "closed" in event["upstream_error"], event
    services = gateway["gw"].app.state.services
    snap = await asyncio.to_thread(gateway["gw"].call, services.state.snapshot(team_id))
    assert snap["reserved_tokens"] == 0 and snap["in_flight"] == 0, "nothing left reserved"
    assert snap["spent_today"] == event["prompt_tokens"] + event["completion_tokens"], "billed what the event says"

    r = await complete(gateway, secret, None)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"
    (first, _), (second, _) = gateway["up"].completions
    assert second != first, "the next request went over a fresh socket"


@pytest.mark.parametrize("case", sorted(GOOD_OR_FAILED))
async def test_a_complete_but_odd_answer_is_relayed_or_failed_cleanly(gateway, case):
    team_id, secret = team(gateway)
    r = await complete(gateway, secret, case)
    assert r.status_code in (503, 200, 204), r.text
    if r.status_code == 503:
        assert r.json()["error"]["code"] == "upstream_unavailable"
    await asyncio.to_thread(events_of, gateway, team_id, 1)
    r = await complete(gateway, secret, None)
    assert r.status_code == 200
    (first, _), (second, _) = gateway["up"].completions
    assert second != first


async def test_interim_answers_before_the_final_one_are_skipped(gateway):
    team_id, secret = team(gateway)
    started = time.monotonic()
    r = await complete(gateway, secret, "interim-then-ok")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"
    (event,) = await asyncio.to_thread(events_of, gateway, team_id, 1)
    assert event["status"] == "ok" and (event["prompt_tokens"], event["completion_tokens"]) == (3, 1)
    assert time.monotonic() - started < 5
