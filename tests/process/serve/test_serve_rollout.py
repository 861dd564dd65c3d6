"""`tokenweir serve --workers 2` as real processes sharing Redis and one store: an alias added through the admin API
is served by both workers within 5 s, and a canary whose upstream fails is rolled back on both while every request
still succeeds (its pool falls back to the stable one). Each worker writes its own event file, so an event says
which worker served the request and under which variant."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.process.serve.test_serve_workers import REDIS_URL, Output, forget_state, lines_of, wait_for
from tests.support.serve_process import serve_process
from tests.support.serve_thread import ServerThread


def ask(url: str, key: str, model: str, n: int) -> list[int]:
    """`n` requests from as many users, each on its own connection (keep-alive would pin them to one worker)."""
    body = {"model": model, "prompt": "one two three", "max_tokens": 2, "fake": {"tokens": 2, "ttft_ms": 5}}

    def one(_: int) -> int:
        headers = {"authorization": f"Bearer {key}"}
        user = {"user": uuid.uuid4().hex}
        return httpx.post(url + "/v1/completions", json=body | user, headers=headers, timeout=30).status_code

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def test_alias_changes_and_a_rollback_reach_both_workers(tmp_path, redis_client):
    db = f"sqlite:///{tmp_path / 'tw.db'}"
    stable, canary = FakeUpstream(model="m"), FakeUpstream(model="m", down=True)
    with ServerThread(stable) as s, ServerThread(canary) as c:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            f"pools:\n  - {{model: v1, upstreams: [{{base_url: '{s.url}', model: m}}]}}\n"
            f"  - {{model: v2, fallbacks: [v1], upstreams: [{{base_url: '{c.url}', model: m}}]}}\n"
            "aliases:\n  - model: chat\n    sticky: user\n"
            "    variants: [{pool: v1, name: stable}, {pool: v2, name: canary}]\n"
            "    rollout: {canary: canary, baseline: stable, steps: [50, 100], step_s: 3600, window_s: 60,"
            " min_requests: 10}\n"
            f"state_url: {REDIS_URL}\nevents: {{path: {tmp_path}/ev.jsonl, flush_interval_s: 0.05}}\n"
            "routing_poll_interval_s: 0.3\n"
        )
        args = ["--no-engine", "--config", str(cfg), "--port", str(free_port()), "--store", db, "--workers", "2"]
        files = [tmp_path / "ev.w0.jsonl", tmp_path / "ev.w1.jsonl"]
        try:
            with serve_process(args) as served:
                out = Output(served.proc, served.output)
                wait_for("both workers ready", lambda: len(out.workers()) == 2)
                admin = {"authorization": f"Bearer {served.admin_key}"}

                def served_by_both(alias: str, variant: str) -> bool:
                    ask(served.url, served.demo_key, alias, 8)
                    return all(
                        f.exists() and any(e.get("alias") == alias and e.get("variant") == variant for e in lines_of(f))
                        for f in files
                    )

                # an alias added at run time: both workers serve it within 5 s
                alias = {"model": "chat2", "variants": [{"pool": "v1", "name": "only"}]}
                r = httpx.put(f"{served.url}/admin/aliases/chat2", json=alias, headers=admin, timeout=30)
                assert r.status_code == 200, r.text
                changed = time.monotonic()
                wait_for("chat2 on both workers", lambda: served_by_both("chat2", "only"), timeout_s=5)
                assert time.monotonic() - changed < 5

                # the failing canary: rolled back by one worker, applied by both; no request fails meanwhile
                statuses: list[int] = []

                def rolled_back() -> bool:
                    statuses.extend(ask(served.url, served.demo_key, "chat", 16))
                    decided = [
                        e for f in files if f.with_suffix(".rollouts.jsonl").exists()
                        for e in lines_of(f.with_suffix(".rollouts.jsonl"))
                    ]  # fmt: skip
                    return any(e["transition"] == "rolled_back" for e in decided)

                wait_for("the canary rolled back", rolled_back, timeout_s=60)
                time.sleep(1.0)  # both workers' routing polls (0.3 s) have passed
                seen = canary.requests_seen
                marks = [len(lines_of(f)) for f in files]
                statuses.extend(ask(served.url, served.demo_key, "chat", 40))
                assert set(statuses) == {200}
                assert canary.requests_seen == seen  # no subject gets the canary any more, on either worker
                after = [e for f, mark in zip(files, marks, strict=True) for e in lines_of(f)[mark:]]
                assert {e["variant"] for e in after if e.get("alias") == "chat"} == {"stable"}
                assert len({f.name for f, mark in zip(files, marks, strict=True) if lines_of(f)[mark:]}) == 2
                states = [
                    httpx.get(f"{served.url}/admin/rollouts", headers=admin, timeout=30).json()["data"][0]
                    for _ in range(6)
                ]
                assert {(s["rollout"]["status"], s["weights"]["canary"]) for s in states} == {("rolled_back", 0.0)}
        finally:
            forget_state(db, redis_client)
