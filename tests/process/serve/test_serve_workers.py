"""`tokenweir serve --workers 2` as real processes on one port: limits shared through the real Redis, a fake
upstream (no model), each worker writing its own event file.

Requests land on both workers; a team's rpm holds exactly across them; a worker killed with SIGKILL is restarted
and replays its own events, once; after SIGTERM every event file holds whole lines, one event per request, and the
billed tokens in the events equal the usage in the store. Without Redis, `--workers 2` refuses to start.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.support.serve_process import ROOT, serve_process
from tests.support.serve_thread import ServerThread
from tokenweir.gateway.store.store import Store

REDIS_URL = "redis://127.0.0.1:6379/0"
READY = re.compile(r"gateway worker (\d+) \(pid (\d+)\) ready")


class Output:
    """The serve process's output after start-up, drained by a thread (a full pipe would block it)."""

    def __init__(self, proc, first: str) -> None:
        self.text, self.lock = first, threading.Lock()
        threading.Thread(target=self._drain, args=(proc,), daemon=True).start()

    def _drain(self, proc) -> None:
        for line in proc.stdout:
            with self.lock:
                self.text += line

    def read(self) -> str:
        with self.lock:
            return self.text

    def workers(self) -> dict[int, int]:
        """Worker index -> pid of its latest start."""
        return {int(m[1]): int(m[2]) for m in READY.finditer(self.read())}


def wait_for(what: str, check, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def burst(url: str, key: str, ids: list[str]) -> list[httpx.Response]:
    """Concurrent requests, each on a connection of its own (keep-alive would pin them to one worker)."""
    body = {"model": "m", "prompt": "one two three", "max_tokens": 4, "fake": {"ttft_ms": 20}}

    def one(request_id: str) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}", "x-request-id": request_id}
        return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, ids))


def lines_of(path: Path) -> list[dict]:
    """Every line of an event file, each required to be one whole JSON object."""
    raw = path.read_bytes()
    assert raw.endswith(b"\n"), f"{path.name}: a torn last line"
    return [orjson.loads(line) for line in raw.splitlines()]


def forget_state(db: str, redis_client) -> None:
    """This test's keys in Redis: its teams' (team ids are random, never reused)."""
    store = Store.open(db)
    try:
        teams = [t.id for t in store.list_teams()]
    finally:
        store.close()
    for team_id in teams:
        stale = list(redis_client.scan_iter(f"tw:{{{team_id}}}:*"))
        if stale:
            redis_client.delete(*stale)


def test_two_workers_share_the_port_the_limits_and_keep_their_own_books(tmp_path, redis_client):
    db = f"sqlite:///{tmp_path / 'tw.db'}"
    fake = FakeUpstream(model="m")
    with ServerThread(fake) as upstream:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            f"pools:\n  - model: m\n    upstreams:\n      - base_url: {upstream.url}\n"
            f"state_url: {REDIS_URL}\nevents: {{path: {tmp_path}/ev.jsonl}}\n"
            "usage_flush_interval_s: 600\n"  # only the shutdown flush and a restart's replay may write usage
        )
        args = ["--no-engine", "--config", str(cfg), "--port", str(free_port()), "--store", db, "--workers", "2"]
        try:
            with serve_process(args) as served:
                out = Output(served.proc, served.output)
                first = wait_for("both workers ready", lambda: len(out.workers()) == 2 and out.workers())
                assert len(set(first.values())) == 2 and served.proc.pid not in first.values()
                admin = {"authorization": f"Bearer {served.admin_key}"}

                sent = [f"open-{i}" for i in range(40)]
                assert all(r.status_code == 200 for r in burst(served.url, served.demo_key, sent))
                files = [tmp_path / "ev.w0.jsonl", tmp_path / "ev.w1.jsonl"]
                assert all(f.exists() and lines_of(f) for f in files), "both workers served requests"

                # A team's rpm, through the admin API of whichever worker answers: exactly 10 of 30 in a minute.
                team = httpx.post(
                    served.url + "/admin/teams",
                    json={"name": f"rpm-{uuid.uuid4().hex[:8]}", "limits": {"rpm": 10}},
                    headers=admin,
                ).json()
                key = httpx.post(served.url + f"/admin/teams/{team['id']}/keys", json={"name": "k"}, headers=admin)
                limited = [f"rpm-{i}" for i in range(30)]
                answers = burst(served.url, key.json()["secret"], limited)
                sent += limited
                assert sorted(r.status_code for r in answers) == [200] * 10 + [429] * 20
                assert {r.json()["error"]["code"] for r in answers if r.status_code == 429} == {"rate_limited"}

                # Worker 1 killed outright: its usage is only in its event file until its restart replays it.
                os.kill(first[1], signal.SIGKILL)
                restarted = wait_for("worker 1 restarted", lambda: out.workers()[1] != first[1] and out.workers())
                assert restarted[0] == first[0] and alive(restarted[1])
                more = [f"after-{i}" for i in range(10)]
                assert all(r.status_code == 200 for r in burst(served.url, served.demo_key, more))
                sent += more

                served.proc.send_signal(signal.SIGTERM)
                assert served.proc.wait(timeout=60) == 128 + signal.SIGTERM
                time.sleep(0.5)  # the drain thread reads the last lines
                text = out.read()
            assert not any(alive(pid) for pid in (*first.values(), *restarted.values())), "workers outlived serve"
            assert text.count("ADMIN key") == 1 and text.count("demo team key") == 1, text
            assert "gateway_worker_exited" in text
            (replayed,) = [orjson.loads(line) for line in text.splitlines() if '"usage_replayed"' in line]
            assert replayed["worker"] == 1 and replayed["writer"].endswith("ev.w1.jsonl"), replayed

            events = [e for f in files for e in lines_of(f)]
            assert sorted(e["request_id"] for e in events) == sorted(sent), "one event per request, in all"
            billed = [e for e in events if e["status"] != "rejected"]
            assert len(billed) == 60
            store = Store.open(db)
            try:
                rows = store.usage()
            finally:
                store.close()
            assert sum(r.requests for r in rows) == len(billed)
            assert (
                (sum(r.prompt_tokens for r in rows), sum(r.completion_tokens for r in rows))
                == (
                    sum(e["prompt_tokens"] for e in billed),
                    sum(e["completion_tokens"] for e in billed),
                )
                == fake.totals()
            )
        finally:
            forget_state(db, redis_client)


def test_workers_whose_parent_is_killed_drain_flush_and_exit(tmp_path, redis_client):
    db = f"sqlite:///{tmp_path / 'tw.db'}"
    with ServerThread(FakeUpstream(model="m")) as upstream:
        env = {
            "TOKENWEIR_STATE_URL": REDIS_URL,
            "TOKENWEIR_UPSTREAM_URL": upstream.url,
            "TOKENWEIR_UPSTREAM_MODEL": "m",
            "TOKENWEIR_EVENTS__PATH": str(tmp_path / "ev.jsonl"),
            "TOKENWEIR_USAGE_FLUSH_INTERVAL_S": "600",
            "TOKENWEIR_WORKERS": "2",
        }
        args = ["--no-engine", "--port", str(free_port()), "--store", db]
        try:
            with serve_process(args, env) as served:
                out = Output(served.proc, served.output)
                pids = wait_for("both workers ready", lambda: len(out.workers()) == 2 and out.workers())
                sent = [f"r-{i}" for i in range(12)]
                assert all(r.status_code == 200 for r in burst(served.url, served.demo_key, sent))
                argv = Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0")
                config_file = Path(argv[argv.index(b"--config") + 1].decode())
                assert config_file.exists()
                served.proc.kill()  # no chance to stop its workers
                wait_for("the orphaned workers to exit", lambda: not any(alive(p) for p in pids.values()))
            assert not config_file.exists(), "the workers removed the config file their parent left"
            events = [e for i in (0, 1) for e in lines_of(tmp_path / f"ev.w{i}.jsonl")]
            assert sorted(e["request_id"] for e in events) == sorted(sent)
            store = Store.open(db)
            try:
                assert sum(r.requests for r in store.usage()) == 12, "each worker flushed on its way out"
            finally:
                store.close()
        finally:
            forget_state(db, redis_client)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_workers_without_the_shared_state_refuse_to_start(tmp_path, how):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWEIR_")}
    cmd = [sys.executable, "-m", "tokenweir.gateway.process.cli", "serve", "--no-engine", "--port", str(free_port())]
    cmd += ["--store", f"sqlite:///{tmp_path / 'tw.db'}"]
    if how == "flag":
        cmd += ["--workers", "2"]
    else:
        env["TOKENWEIR_WORKERS"] = "2"
    env["TOKENWEIR_UPSTREAM_URL"] = "http://127.0.0.1:9"  # a pool, so only the state can be what is missing
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "--workers 2 needs the shared state" in proc.stderr and "TOKENWEIR_STATE_URL" in proc.stderr
    assert "state_url: redis://" in proc.stderr and "gateway on" not in proc.stdout
    assert not (tmp_path / "tw.db").exists(), "refused before anything was started or written"
