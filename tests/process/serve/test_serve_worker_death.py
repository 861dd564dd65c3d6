"""A gateway worker killed with SIGKILL under `tokenweir serve --workers 2` costs nothing: real processes, the real
Redis, a fake upstream that answers POST /abort with the usage it made (as our engine does).

The restart of the killed worker settles the requests it had in flight (gateway/request/inflight.py): every token the
upstream served for them is billed, each gets one event, and the team's concurrency slots and budget holds the
dead worker held are free as soon as it serves again, not when their leases expire.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.process.serve.test_serve_workers import (
    REDIS_URL,
    Output,
    alive,
    forget_state,
    lines_of,
    wait_for,
)
from tests.support.serve_process import serve_process
from tests.support.serve_thread import ServerThread
from tokenweir.gateway.store.store import Store

STREAMS = 8  # the team's max_concurrency too: every slot is taken by the burst of slow streams


def accepted_connections(pid: int, port: int) -> int:
    """How many client connections to `port` the process `pid` holds (its sockets' inodes in /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local_port = int(cols[1].rsplit(":", 1)[1], 16)
            count += local_port == port and cols[3] == "01" and cols[9] in inodes  # 01: ESTABLISHED
    return count


def stream(url: str, key: str, request_id: str, outcome: dict) -> None:
    """One slow stream; `outcome[request_id]` says whether it ended with [DONE] (False: the worker died)."""
    body = {"model": "m", "prompt": "one two three", "max_tokens": 40, "stream": True}
    body["fake"] = {"tokens": 40, "itl_ms": 150}
    headers = {"authorization": f"Bearer {key}", "x-request-id": request_id}
    done = False
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            for line in r.iter_lines():
                done = done or line == "data: [DONE]"
    except httpx.HTTPError:
        pass
    outcome[request_id] = done


def test_a_killed_workers_requests_are_billed_and_its_slots_freed_by_its_restart(tmp_path, redis_client):
    db = f"sqlite:///{tmp_path / 'tw.db'}"
    fake = FakeUpstream(model="m")
    with ServerThread(fake) as upstream:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            f"pools:\n  - model: m\n    upstreams:\n      - base_url: {upstream.url}\n"
            f"state_url: {REDIS_URL}\nevents: {{path: {tmp_path}/ev.jsonl}}\n"
            "usage_flush_interval_s: 600\n"
        )
        port = free_port()
        args = ["--no-engine", "--config", str(cfg), "--port", str(port), "--store", db, "--workers", "2"]
        try:
            with serve_process(args) as served:
                out = Output(served.proc, served.output)
                first = wait_for("both workers ready", lambda: len(out.workers()) == 2 and out.workers())
                admin = {"authorization": f"Bearer {served.admin_key}"}
                limits = {"max_concurrency": STREAMS}
                team = httpx.post(
                    served.url + "/admin/teams",
                    json={"name": f"die-{uuid.uuid4().hex[:8]}", "limits": limits},
                    headers=admin,
                ).json()
                key = httpx.post(served.url + f"/admin/teams/{team['id']}/keys", json={"name": "k"}, headers=admin)
                secret = key.json()["secret"]

                outcome: dict[str, bool] = {}
                threads = [
                    threading.Thread(target=stream, args=(served.url, secret, f"s-{i}", outcome))
                    for i in range(STREAMS)
                ]
                for t in threads:
                    t.start()
                wait_for("every stream running upstream", lambda: fake.running() == STREAMS)
                held = {i: accepted_connections(pid, port) for i, pid in first.items()}
                victim = max(held, key=held.get)
                assert held[victim] >= 1, held
                os.kill(first[victim], signal.SIGKILL)
                killed_at = time.monotonic()
                restarted = wait_for(
                    "the killed worker restarted", lambda: out.workers()[victim] != first[victim] and out.workers()
                )
                ready_at = time.monotonic()
                print(f"restarted {ready_at - killed_at:.2f}s after the kill")
                assert alive(restarted[victim]) and restarted[1 - victim] == first[1 - victim]
                for t in threads:
                    t.join(timeout=60)
                killed = sorted(rid for rid, done in outcome.items() if not done)
                assert len(killed) == held[victim], (outcome, held)

                # Every slot is free again: a burst of max_concurrency overlapping requests is admitted in full.
                body = {"model": "m", "prompt": "one two", "max_tokens": 4, "fake": {"ttft_ms": 800}}

                def one(i: int) -> int:
                    headers = {"authorization": f"Bearer {secret}", "x-request-id": f"b-{i}"}
                    return httpx.post(served.url + "/v1/completions", json=body, headers=headers, timeout=30)

                with ThreadPoolExecutor(STREAMS) as pool:
                    answers = list(pool.map(one, range(STREAMS)))
                codes = sorted(r.status_code for r in answers)
                freed_s = time.monotonic() - ready_at
                assert codes == [200] * STREAMS, (codes, [r.text for r in answers if r.status_code != 200])

                served.proc.send_signal(signal.SIGTERM)
                assert served.proc.wait(timeout=60) == 128 + signal.SIGTERM
            print(f"killed {len(killed)} of {STREAMS} streams; slots all free {freed_s:.2f}s after the restart")

            events = [e for i in (0, 1) for e in lines_of(tmp_path / f"ev.w{i}.jsonl")]
            sent = [f"s-{i}" for i in range(STREAMS)] + [f"b-{i}" for i in range(STREAMS)]
            assert sorted(e["request_id"] for e in events) == sorted(sent), "one event per request, the killed too"
            died = {e["request_id"]: e for e in events if e["reason"] == "worker_died"}
            assert sorted(died) == killed
            for e in died.values():
                # What the upstream says it made for that very attempt (the abort stopped it)
                assert e["upstream_request_id"] in fake.records, ("its attempt was journaled at dispatch", e)
                made = fake.records[e["upstream_request_id"]]
                assert e["status"] == "error" and e["usage_source"] == "engine_abort", e
                assert (e["prompt_tokens"], e["completion_tokens"]) == (made.prompt_tokens, made.completion_tokens)
                assert made.completion_tokens > 0 and made.status != "running", made
            store = Store.open(db)
            try:
                rows = store.usage()
            finally:
                store.close()
            billed = (sum(r.prompt_tokens for r in rows), sum(r.completion_tokens for r in rows))
            assert billed == fake.totals(), "every token the upstream served is billed"
            assert sum(r.requests for r in rows) == 2 * STREAMS
            # Nothing is left held in the shared state: no lease, no hold.
            assert not redis_client.zcard(f"tw:{{{team['id']}}}:slots")
            assert not redis_client.zcard(f"tw:{{{team['id']}}}:holds")
        finally:
            forget_state(db, redis_client)


@pytest.fixture(autouse=True)
def _linux_only():
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("reads worker sockets from /proc")
