"""A batch survives its gateway being SIGKILLed mid-batch: `tokenweir serve` as a real process, killed while lines
run, started again on the same store and event log: the batch resumes where its rows say it stopped and completes,
every line is in the output or error file exactly once, no line was answered twice, and what was billed is what the
events say (the lines answered, plus what the lines in flight at the kill had made, which the restart's in-flight
recovery bills and the batch fails as `interrupted` rather than run again)."""

from __future__ import annotations

import time
from collections import Counter

import openai
import orjson

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.support.serve_process import serve_process
from tests.support.serve_thread import ServerThread
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.store.store import Store

LINES = 40
CHAT = "/v1/chat/completions"


def input_file() -> bytes:
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": CHAT,
         "body": {"model": "m", "messages": [{"role": "user", "content": f"line {i} says hi"}], "max_tokens": 4,
                  "fake": {"ttft_ms": 150}}}
        for i in range(LINES)
    ]  # fmt: skip
    return b"\n".join(orjson.dumps(line) for line in lines)


def test_a_batch_resumes_after_its_gateway_is_killed_and_answers_every_line_once(tmp_path):
    fake = FakeUpstream(model="m")
    with ServerThread(fake) as upstream:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            f"pools:\n  - model: m\n    upstreams:\n      - base_url: {upstream.url}\n"
            f"events: {{path: {tmp_path}/ev.jsonl, flush_interval_s: 0.05}}\nusage_flush_interval_s: 0.1\n"
            "batches: {concurrency: 3, poll_interval_s: 0.1, lease_s: 3}\n"
        )
        db = f"sqlite:///{tmp_path}/tw.db"
        args = ["--no-engine", "--config", str(cfg), "--store", db]
        with serve_process([*args, "--port", str(free_port())]) as served:
            key = served.demo_key
            client = openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0)
            uploaded = client.files.create(file=("in.jsonl", input_file()), purpose="batch")
            batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
            deadline = time.monotonic() + 30
            while client.batches.retrieve(batch.id).request_counts.completed < 8:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            served.proc.kill()  # SIGKILL: lines in flight, nothing flushed on the way out
            served.proc.wait(timeout=10)
        before = sum(1 for e in read_events(tmp_path / "ev.jsonl") if e.get("batch_id") == batch.id)
        assert 8 <= before < LINES, "killed mid-batch"
        with serve_process([*args, "--port", str(free_port())]) as served:
            client = openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0)
            deadline = time.monotonic() + 60
            while (ended := client.batches.retrieve(batch.id)).status != "completed":
                assert time.monotonic() < deadline, ended.status
                time.sleep(0.1)
            output = [orjson.loads(x) for x in client.files.content(ended.output_file_id).content.splitlines()]
            errors = []
            if ended.error_file_id is not None:
                errors = [orjson.loads(x) for x in client.files.content(ended.error_file_id).content.splitlines()]
            time.sleep(0.5)  # the last usage flush
    assert sorted(o["custom_id"] for o in output + errors) == sorted(f"req-{i}" for i in range(LINES)), "once each"
    assert {e["error"]["code"] for e in errors} <= {"interrupted"} and len(errors) <= 3, "only lines in flight"
    assert (ended.request_counts.completed, ended.request_counts.failed) == (len(output), len(errors))
    events = [e for e in read_events(tmp_path / "ev.jsonl") if e.get("batch_id") == batch.id]
    served_ids = Counter(e["request_id"] for e in events if e["status"] == "ok")
    assert sorted(served_ids) == sorted(o["response"]["request_id"] for o in output)
    assert set(served_ids.values()) == {1}, "no line answered twice"
    recovered = {e["request_id"] for e in events if e["reason"] == "worker_died"}  # billed by the restart
    assert recovered <= {f"{batch.id}-{int(e['custom_id'].removeprefix('req-')) + 1}" for e in errors}
    answered = sum(o["response"]["body"]["usage"]["total_tokens"] for o in output)
    assert sum(e["prompt_tokens"] + e["completion_tokens"] for e in events if e["status"] == "ok") == answered
    store = Store.open(db)
    try:
        billed = sum(r.prompt_tokens + r.completion_tokens for r in store.usage())
    finally:
        store.close()
    assert billed == sum(e["prompt_tokens"] + e["completion_tokens"] for e in events), "billing is the events"
    assert fake.requests_seen <= LINES + 3, "a line is sent upstream once (the ones in flight at most once more)"
