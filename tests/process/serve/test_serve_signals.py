"""`tokenweir serve` as a real process: bootstrap keys printed, and SIGTERM flushes usage and events."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.support.serve_process import serve_process
from tests.support.serve_thread import ServerThread
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.store.store import Store


def test_serve_prints_keys_and_sigterm_flushes_usage_and_events(tmp_path):
    fake = FakeUpstream(model="m")
    with ServerThread(fake) as upstream:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            f"pools:\n  - model: m\n    upstreams:\n      - base_url: {upstream.url}\n"
            # usage flushes far apart: only the shutdown flush can have written what we find afterwards
            f"events: {{path: {tmp_path}/ev.jsonl, flush_interval_s: 600}}\nusage_flush_interval_s: 600\n"
        )
        db = tmp_path / "tw.db"
        args = ["--no-engine", "--config", str(cfg), "--port", str(free_port()), "--store", f"sqlite:///{db}"]
        with serve_process(args) as served:
            proc, url, admin, demo = served.proc, served.url, served.admin_key, served.demo_key
            body = {"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}
            for _ in range(3):
                r = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {demo}"})
                assert r.status_code == 200, r.text
            r = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {admin}"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "no_team"
            assert len(read_events(tmp_path / "ev.jsonl")) == 4, "events are the write-ahead record: on disk at once"
            before = Store.open(f"sqlite:///{db}")
            try:
                assert not before.usage(), "usage was flushed before shutdown: this test would prove nothing"
            finally:
                before.close()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    events = read_events(tmp_path / "ev.jsonl")
    assert [(e["status"], e["reason"]) for e in events] == [("ok", None)] * 3 + [("rejected", "no_team")]
    store = Store.open(f"sqlite:///{db}")
    try:
        (row,) = store.usage()
        assert (row.requests, row.prompt_tokens, row.completion_tokens) == (3, 9, 9)
    finally:
        store.close()


def test_sigterm_cuts_a_long_stream_after_the_grace_and_still_bills_it(tmp_path):
    fake = FakeUpstream(model="m")
    with ServerThread(fake) as upstream:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            f"pools:\n  - model: m\n    upstreams:\n      - base_url: {upstream.url}\n"
            f"events: {{path: {tmp_path}/ev.jsonl, flush_interval_s: 600}}\n"
            "usage_flush_interval_s: 600\nshutdown_grace_s: 0.5\n"
        )
        db = tmp_path / "tw.db"
        args = ["--no-engine", "--config", str(cfg), "--port", str(free_port()), "--store", f"sqlite:///{db}"]
        with serve_process(args) as served:
            proc, url, demo = served.proc, served.url, served.demo_key
            body = {"model": "m", "prompt": "a b c", "max_tokens": 200, "stream": True, "fake": {"itl_ms": 50}}
            body["fake"]["tokens"] = 200  # 10 s of stream: far longer than the grace
            headers = {"authorization": f"Bearer {demo}", "x-request-id": "cut-by-shutdown"}
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=30) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]  # the server ends the stream after the grace
            proc.wait(timeout=30)
    assert rest[-1] == "data: [DONE]" and '"code":"shutting_down"' in rest[-2], rest[-3:]
    (event,) = read_events(tmp_path / "ev.jsonl")
    record = fake.records[event["upstream_request_id"]]
    assert event["request_id"] == "cut-by-shutdown"
    assert (event["status"], event["reason"]) == ("cancelled", "shutdown") and event[
        "upstream_request_id"
    ] in fake.aborts
    assert 0 < event["completion_tokens"] == record.completion_tokens < 200, (event, record, len(rest))
    store = Store.open(f"sqlite:///{db}")
    try:
        (row,) = store.usage()
        assert (row.prompt_tokens, row.completion_tokens) == (3, record.completion_tokens)
    finally:
        store.close()


def test_sigterm_past_the_grace_answers_a_waiting_request_with_a_json_503(tmp_path):
    fake = FakeUpstream(model="m")
    with ServerThread(fake) as upstream:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            f"pools:\n  - model: m\n    upstreams:\n      - base_url: {upstream.url}\n"
            f"events: {{path: {tmp_path}/ev.jsonl}}\nshutdown_grace_s: 0.5\n"
        )
        args = ["--no-engine", "--config", str(cfg), "--port", str(free_port()), "--store", f"sqlite:///{tmp_path}/d"]
        with serve_process(args) as served:
            body = {"model": "m", "prompt": "a b c", "max_tokens": 5, "fake": {"ttft_ms": 10_000}}
            headers = {"authorization": f"Bearer {served.demo_key}", "x-request-id": "waits-past-grace"}
            with httpx.Client(timeout=30) as client:
                answer = {}
                t = threading.Thread(
                    target=lambda: answer.setdefault(
                        "r", client.post(served.url + "/v1/completions", json=body, headers=headers)
                    )
                )
                t.start()
                while not fake.records:
                    time.sleep(0.02)
                served.proc.send_signal(signal.SIGTERM)
                t.join(30)
            served.proc.wait(timeout=30)
    r = answer["r"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    assert r.json()["error"]["code"] == "shutting_down"
    (event,) = read_events(tmp_path / "ev.jsonl")
    assert (event["request_id"], event["http_status"], event["reason"]) == ("waits-past-grace", 503, "shutdown")
