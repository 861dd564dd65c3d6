"""OpenAI batch jobs through the `openai` SDK: /v1/files and /v1/batches against a gateway served by uvicorn in front
of the fake upstream, on SQLite and on PostgreSQL. Each line is run through the request path as its own request:
answered once, billed once, one event naming its batch."""

from __future__ import annotations

import asyncio
import time

import openai
import orjson
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.metrics import gateway_metrics
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.stack import team
from tests.support.store import open_store
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import BatchesConfig, EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.policies.limits import TeamLimits

MODEL = "fake-model"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"batches-{request.param}")
    fake = FakeUpstream(model=MODEL)
    with open_store(request.param, tmp) as store, ServerThread(fake) as upstream:
        config = GatewayConfig(
            port=0,
            pools=[PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream.url)], max_context=4096)],
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
            batches=BatchesConfig(max_file_bytes=64 * 1024, concurrency=3, poll_interval_s=0.1, lease_s=3.0),
        )
        with serve_app(config, store=store) as gw:
            yield {"fake": fake, "store": store, "url": gw.url, "events": tmp / "events.jsonl", "config": config}


def client_of(stack, secret: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack["url"] + "/v1", api_key=secret, max_retries=0)


def chat_lines(n: int, max_tokens: int = 3, **body) -> bytes:
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": CHAT,
         "body": {"model": MODEL, "messages": [{"role": "user", "content": f"hello number {i}"}],
                  "max_tokens": max_tokens, **body}}
        for i in range(n)
    ]  # fmt: skip
    return b"\n".join(orjson.dumps(line) for line in lines) + b"\n"


async def run_batch(client: openai.AsyncOpenAI, data: bytes, timeout: float = 30.0, **create):
    uploaded = await client.files.create(file=("input.jsonl", data), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", **create)
    return await wait_ended(client, batch.id, timeout)


async def wait_ended(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        await asyncio.sleep(0.05)


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [orjson.loads(line) for line in content.content.splitlines() if line.strip()]


def batch_events(stack, batch_id: str, n: int, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        events = [e for e in read_events(stack["events"]) if e.get("batch_id") == batch_id]
        if len(events) >= n or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def billed_tokens(stack, team_id: str, timeout: float = 5.0, want: int | None = None) -> int:
    deadline = time.monotonic() + timeout
    while True:
        rows = stack["store"].usage(team_id)
        total = sum(r.prompt_tokens + r.completion_tokens for r in rows)
        if want is None or total >= want or time.monotonic() > deadline:
            return total
        time.sleep(0.05)


def lines_metric(stack, outcome: str) -> float:
    return gateway_metrics(stack["url"]).get(("tokenweir_gateway_batch_lines_total", (("outcome", outcome),)), 0.0)


async def test_every_line_is_answered_once_billed_once_with_one_event_naming_its_batch(stack):
    team_id, secret = team(stack)
    client = client_of(stack, secret)
    completed_before = lines_metric(stack, "completed")
    batch = await run_batch(client, chat_lines(12), metadata={"job": "nightly"})
    assert batch.status == "completed" and batch.metadata == {"job": "nightly"}
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (12, 12, 0)
    assert batch.error_file_id is None and batch.completed_at is not None and batch.in_progress_at is not None
    output = await lines_of(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(12)), "each line once"
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] == "tok " * 3 for o in output)
    served = sum(o["response"]["body"]["usage"]["total_tokens"] for o in output)
    events = batch_events(stack, batch.id, 12)
    assert len(events) == 12 and all(e["status"] == "ok" and e["priority"] == 2 for e in events)
    assert sorted(e["request_id"] for e in events) == sorted(o["response"]["request_id"] for o in output)
    assert sum(e["prompt_tokens"] + e["completion_tokens"] for e in events) == served
    assert billed_tokens(stack, team_id, want=served) == served
    assert lines_metric(stack, "completed") - completed_before == 12


async def test_a_batch_over_the_budget_stops_there_and_fails_the_rest_as_budget_exhausted(stack):
    # each line reserves 4 prompt + 3 output tokens: the budget admits a few, then refuses
    team_id, secret = team(stack, TeamLimits(tokens_per_day=40))
    client = client_of(stack, secret)
    batch = await run_batch(client, chat_lines(20))
    assert batch.status == "completed"
    output, errors = await lines_of(client, batch.output_file_id), await lines_of(client, batch.error_file_id)
    assert 1 <= len(output) < 20 and len(output) + len(errors) == 20
    assert sorted(o["custom_id"] for o in output + errors) == sorted(f"req-{i}" for i in range(20))
    codes = {(e["error"] or {}).get("code") or e["response"]["body"]["error"]["code"] for e in errors}
    assert codes == {"budget_exhausted"}
    assert lines_metric(stack, "budget_exhausted") >= 1
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(output), len(errors))
    served = sum(o["response"]["body"]["usage"]["total_tokens"] for o in output)
    assert served <= 40
    assert billed_tokens(stack, team_id, want=served) == served


async def test_another_teams_file_and_batch_read_as_missing(stack):
    _, secret = team(stack)
    _, other_secret = team(stack)
    mine, theirs = client_of(stack, secret), client_of(stack, other_secret)
    batch = await run_batch(mine, chat_lines(1))
    uploaded = await mine.files.create(file=("x.jsonl", chat_lines(1)), purpose="batch")
    for call in (
        theirs.files.retrieve(uploaded.id),
        theirs.files.content(uploaded.id),
        theirs.files.delete(uploaded.id),
        theirs.batches.retrieve(batch.id),
        theirs.batches.cancel(batch.id),
        theirs.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h"),
        theirs.files.content(batch.output_file_id),
    ):
        with pytest.raises(openai.NotFoundError):
            await call
    assert uploaded.id not in [f.id async for f in theirs.files.list()]
    assert batch.id not in [b.id async for b in theirs.batches.list()]
    assert batch.id in [b.id async for b in mine.batches.list()]
    assert (await mine.files.delete(uploaded.id)).deleted is True
    with pytest.raises(openai.NotFoundError):
        await mine.files.retrieve(uploaded.id)


@pytest.mark.parametrize(
    ("content", "line", "words"),
    [
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\nnot json\n', 2, "JSON"),
        (chat_lines(2).replace(b"req-1", b"req-0"), 2, "unique"),
        (chat_lines(1).replace(b"/v1/chat/completions", b"/v1/embeddings"), 1, "endpoint"),
        (chat_lines(1).replace(b'"POST"', b'"GET"'), 1, "method"),
        (chat_lines(1, stream=True), 1, "stream"),
        (b'{"custom_id": "a", "url": "/v1/chat/completions", "body": {}}\n', 1, "method"),
    ],
)
async def test_a_bad_input_file_is_refused_at_create_naming_its_line(stack, content, line, words):
    _, secret = team(stack)
    client = client_of(stack, secret)
    uploaded = await client.files.create(file=("bad.jsonl", content), purpose="batch")
    with pytest.raises(openai.BadRequestError) as exc:
        await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    error = exc.value.body
    assert exc.value.code == "invalid_input_file" and error["param"] == "input_file_id"
    assert f"Line {line} " in error["message"] and words in error["message"]


async def test_bad_uploads_and_batch_bodies_are_openai_errors(stack):
    _, secret = team(stack)
    client = client_of(stack, secret)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.files.create(file=("x.jsonl", chat_lines(1)), purpose="fine-tune")
    assert exc.value.code == "invalid_purpose" and exc.value.body["param"] == "purpose"
    with pytest.raises(openai.APIStatusError) as big:
        await client.files.create(file=("x.jsonl", b"x" * (64 * 1024 + 1)), purpose="batch")
    assert big.value.status_code == 413 and big.value.code == "file_too_large"
    uploaded = await client.files.create(file=("x.jsonl", chat_lines(1)), purpose="batch")
    wrongs = ({"endpoint": "/v1/moderations"}, {"endpoint": "/v1/responses"}, {"completion_window": "1h"})
    for wrong in (*wrongs, {"metadata": {"k": 1}}):
        args = {"input_file_id": uploaded.id, "endpoint": CHAT, "completion_window": "24h", **wrong}
        with pytest.raises(openai.BadRequestError) as exc:
            await client.batches.create(**args)
        assert exc.value.body["param"].split(".")[0] == next(iter(wrong))  # metadata.k names the value


async def test_a_line_the_request_path_refuses_is_in_the_error_file_with_its_answer(stack):
    _, secret = team(stack)
    client = client_of(stack, secret)
    data = chat_lines(2) + orjson.dumps(
        {"custom_id": "bad", "method": "POST", "url": CHAT, "body": {"model": "no-such-model", "messages": []}}
    )
    batch = await run_batch(client, data)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    (error,) = await lines_of(client, batch.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "messages"
    (event,) = [e for e in batch_events(stack, batch.id, 3) if e["request_id"] == error["response"]["request_id"]]
    assert event["status"] == "rejected" and event["http_status"] == 400


async def test_cancel_stops_starting_lines_and_lets_running_ones_end(stack):
    _, secret = team(stack)
    client = client_of(stack, secret)
    uploaded = await client.files.create(file=("x.jsonl", chat_lines(30, fake={"ttft_ms": 150})), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    while (await client.batches.retrieve(batch.id)).request_counts.completed < 3:
        await asyncio.sleep(0.05)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = await wait_ended(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    output, errors = await lines_of(client, batch.output_file_id), await lines_of(client, batch.error_file_id)
    assert 3 <= len(output) < 30 and len(output) + len(errors) == 30
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert len(batch_events(stack, batch.id, len(output))) == len(output), "only the lines run have events"
    assert (await client.batches.cancel(batch.id)).status == "cancelled", "cancelling again is idempotent"
    done = await run_batch(client, chat_lines(1))
    with pytest.raises(openai.ConflictError) as exc:
        await client.batches.cancel(done.id)
    assert exc.value.code == "batch_not_cancellable"


async def test_lines_not_run_within_the_completion_window_expire(stack):
    _, secret = team(stack)
    client = client_of(stack, secret)
    stack["config"].batches.completion_window_s = 2.0  # the "24h" window, shortened for this batch
    try:
        uploaded = await client.files.create(file=("x.jsonl", chat_lines(40, fake={"ttft_ms": 200})), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    finally:
        stack["config"].batches.completion_window_s = 24 * 3600.0
    batch = await wait_ended(client, batch.id)
    assert batch.status == "expired" and batch.expired_at is not None
    output, errors = await lines_of(client, batch.output_file_id), await lines_of(client, batch.error_file_id)
    assert output and errors and len(output) + len(errors) == 40
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert len(batch_events(stack, batch.id, len(output))) == len(output), "billed only for what ran"


async def test_a_teamless_admin_key_may_not_upload(stack):
    admin, _ = stack["store"].create_key(None, "admin", is_admin=True)
    with pytest.raises(openai.PermissionDeniedError) as exc:
        await client_of(stack, admin).files.create(file=("x.jsonl", chat_lines(1)), purpose="batch")
    assert exc.value.code == "no_team"


async def test_lines_refused_for_now_wait_and_are_tried_again(stack):
    # the team runs one request at a time; the batch runs three lines at once: two of each three are refused
    # (concurrency, 429) and retried until they get the slot
    team_id, secret = team(stack, TeamLimits(max_concurrency=1, tokens_per_day=1_000_000))
    client = client_of(stack, secret)
    batch = await run_batch(client, chat_lines(6, fake={"ttft_ms": 30}))
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 6, 0)
    output = await lines_of(client, batch.output_file_id)
    events = [e for e in batch_events(stack, batch.id, 6) if e["status"] == "ok"]
    assert sorted(e["request_id"] for e in events) == sorted(o["response"]["request_id"] for o in output)
    refused = [e for e in read_events(stack["events"]) if e.get("batch_id") == batch.id and e["status"] != "ok"]
    assert refused and {e["reason"] for e in refused} == {"concurrency"}
    assert all(e["prompt_tokens"] == e["completion_tokens"] == 0 for e in refused), "a refusal bills nothing"
    served = sum(o["response"]["body"]["usage"]["total_tokens"] for o in output)
    assert billed_tokens(stack, team_id, want=served) == served


async def test_batch_lines_leave_the_interactive_headroom_of_their_pool_free(tmp_path):
    fake = FakeUpstream(model=MODEL)
    with open_store("sqlite", tmp_path) as store, ServerThread(fake) as upstream:
        config = GatewayConfig(
            port=0,
            pools=[PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream.url)], capacity=3)],
            events=EventsConfig(path=str(tmp_path / "events.jsonl")),
            batches=BatchesConfig(concurrency=3, poll_interval_s=0.1, interactive_headroom=1),
        )
        with serve_app(config, store=store) as gw:
            _, secret = team({"store": store})
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=secret, max_retries=0)
            batch = await run_batch(client, chat_lines(9, fake={"ttft_ms": 60}))
    assert batch.request_counts.completed == 9
    assert fake.peak_in_progress == 2, "three slots, one left free: two lines at once, never three"


async def test_beside_an_interactive_request_in_flight_a_batch_runs_one_line_at_a_time(tmp_path):
    fake = FakeUpstream(model=MODEL)
    with open_store("sqlite", tmp_path) as store, ServerThread(fake) as upstream:
        config = GatewayConfig(
            port=0,
            pools=[PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream.url)], capacity=8)],
            events=EventsConfig(path=str(tmp_path / "events.jsonl")),
            batches=BatchesConfig(concurrency=4, poll_interval_s=0.1, concurrency_beside_interactive=1),
        )
        with serve_app(config, store=store) as gw:
            _, secret = team({"store": store})
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=secret, max_retries=0)
            ask = [{"role": "user", "content": "a long answer"}]
            slow = asyncio.create_task(
                client.chat.completions.create(
                    model=MODEL, messages=ask, max_tokens=3, extra_body={"fake": {"ttft_ms": 4000}}
                )
            )
            for _ in range(200):  # the interactive request is in flight at the upstream
                if fake.in_progress:
                    break
                await asyncio.sleep(0.01)
            batch = await run_batch(client, chat_lines(6, fake={"ttft_ms": 60}))
            assert not slow.done(), "the batch ran while the interactive request was in flight"
            assert batch.request_counts.completed == 6
            assert fake.peak_in_progress == 2, "one interactive request and one batch line at a time, never more"
            await slow
            alone = await run_batch(client, chat_lines(8, fake={"ttft_ms": 200}))
    assert alone.request_counts.completed == 8
    assert fake.peak_in_progress == 4, "with no interactive request in flight, the batch's full concurrency"
