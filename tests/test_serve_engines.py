"""`tokenweir serve --engines 2`, for real: two supervised engine children on SmolLM2 behind one prefix-routed pool.

Four teams with distinct ~300-token system prompts, interleaved: each team stays on one engine and both engines take
traffic. Then one engine is SIGKILLed in the middle of a stream: that stream ends with an `upstream_broken` error
naming the instance (one event), new requests go to the other engine and succeed, the supervisor restarts the killed
one (a warning log line, `tokenweir_gateway_engine_restarts_total`), its circuit closes once its /load answers, and
it takes traffic again.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from gateway.events import read_events
from loadtests.fake_upstream import free_port
from tests.serve_process import serve_process

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
TEAMS = ("Aurora", "Basalt", "Cobalt", "Dune")
STARTED = re.compile(r"engine (\d+) \(pid (\d+)\) starting on (http://\S+)")


def system_prompt(team: str) -> str:
    """~300 tokens, distinct from the first words on (the first KV block decides a new prefix's home engine)."""
    rules = " ".join(f"Rule {i} of team {team}: answer briefly, kindly and precisely." for i in range(28))
    return f"{team} {team} {team}. You are the assistant of team {team}. {rules}"


class Output:
    """The serve process's output, drained by a thread (a full pipe would block it)."""

    def __init__(self, proc, first: str) -> None:
        self.text, self.lock = first, threading.Lock()
        self.thread = threading.Thread(target=self._drain, args=(proc,), daemon=True)
        self.thread.start()

    def _drain(self, proc) -> None:
        for line in proc.stdout:
            with self.lock:
                self.text += line

    def read(self) -> str:
        with self.lock:
            return self.text

    def engines(self) -> dict[int, tuple[int, str]]:
        """Engine index -> (pid, url) of its latest start."""
        return {int(m[1]): (int(m[2]), m[3]) for m in STARTED.finditer(self.read())}

    def all_pids(self) -> set[int]:
        return {int(m[2]) for m in STARTED.finditer(self.read())}


def wait_for(what: str, check, timeout_s: float, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")


def metric_value(text: str, name: str, **labels: str) -> float | None:
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    return None


def engine_of(event: dict) -> str:
    return event["instance"].split("@", 1)[1]


def _kill_leftover(pid: int) -> None:
    """A pid the serve process started (an engine child) still alive after it exited: kill it, if it is one."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"engine.server" in cmdline:
        os.kill(pid, signal.SIGKILL)


def stop_serve(served, out: Output) -> None:
    """SIGTERM the serve process (it stops its engines on the way out), then kill any engine child it left."""
    if served.proc.poll() is None:
        served.proc.send_signal(signal.SIGTERM)
        try:
            served.proc.wait(timeout=40)
        except Exception:
            served.proc.kill()
            served.proc.wait()
    for pid in out.all_pids():
        _kill_leftover(pid)


def test_serve_two_engines_routes_by_prefix_and_survives_a_killed_engine(tmp_path):
    t_start = time.monotonic()
    events_path = tmp_path / "events.jsonl"
    args = ["--port", str(free_port()), "--engine-port", str(free_port()), "--engines", "2"]
    args += ["--store", f"sqlite:///{tmp_path / 'tw.db'}"]
    env = {
        "TOKENWEIR_EVENTS__PATH": str(events_path),
        "TOKENWEIR_ENGINE__RESTART_BACKOFF_S": "0.2",
        "TOKENWEIR_LOAD_POLL_INTERVAL_S": "0.25",
        # dense weights: no start-up int8 probe (faster starts and restarts on a small CI machine)
        "TOKENWEIR_ENGINE__EXTRA_ARGS": '["--quantization", "none"]',
    }
    with serve_process(args, env, timeout_s=240) as served:
        out = Output(served.proc, served.output)
        try:
            _exercise(served, out, events_path, t_start)
        finally:
            stop_serve(served, out)


def _exercise(served, out: Output, events_path: Path, t_start: float) -> None:
    engines = out.engines()
    assert sorted(engines) == [0, 1], out.read()
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=served.demo_key, max_retries=0, timeout=60)
    events: dict[str, dict] = {}

    def ask(team: str, tag: str, max_tokens: int = 3) -> str:
        rid = f"{tag}-{team}-{uuid.uuid4().hex[:8]}"
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system_prompt(team)}, {"role": "user", "content": "Hi!"}],
            max_tokens=max_tokens,
            temperature=0,
            extra_headers={"x-request-id": rid},
        )
        assert chat.choices[0].message.content is not None
        return rid

    def event(rid: str) -> dict:
        def find():
            for e in read_events(events_path):
                events[e["request_id"]] = e
            return events.get(rid)

        return wait_for(f"the event of {rid}", find, 10)

    # 1. Four teams, two rounds, interleaved: each team's requests on one engine (its prefix is cached there), and
    # both engines used.
    placed: dict[str, list[str]] = {team: [] for team in TEAMS}
    for round_ in range(2):
        for team in TEAMS:
            rid = ask(team, f"r{round_}")
            e = event(rid)
            assert e["status"] == "ok", e
            placed[team].append(engine_of(e))
    for where in placed.values():
        top = Counter(where).most_common(1)[0][1]
        assert top / len(where) >= 0.8, placed
    assert {w for where in placed.values() for w in where} == {"engine-0", "engine-1"}, placed
    second = [event(rid) for rid in list(events) if rid.startswith("r1-")]
    assert all((e["cached_tokens"] or 0) >= 256 for e in second), second  # the second round hit the prefix cache

    # 2. SIGKILL the engine under a stream, once the stream is under way.
    victim_team = TEAMS[0]
    victim = placed[victim_team][-1]
    victim_index = int(victim.removeprefix("engine-"))
    other = f"engine-{1 - victim_index}"
    victim_pid = engines[victim_index][0]
    stream_rid = f"kill-{uuid.uuid4().hex[:8]}"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": system_prompt(victim_team)},
            {"role": "user", "content": "Count from one to two hundred, in words."},
        ],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_headers={"x-request-id": stream_rid},
    )
    got = 0
    with pytest.raises(openai.APIError) as broke:
        for _ in stream:
            got += 1
            if got == 3:
                os.kill(victim_pid, signal.SIGKILL)
    assert got >= 3
    assert "broke off" in str(broke.value) and victim in str(broke.value), str(broke.value)
    e = event(stream_rid)
    assert (e["status"], e["reason"], e["http_status"], engine_of(e)) == ("error", "upstream_broken", 502, victim), e
    assert sum(1 for x in read_events(events_path) if x["request_id"] == stream_rid) == 1

    # 3. Meanwhile every team is served by the other engine.
    killed_at = time.monotonic()
    for team in TEAMS:
        e = event(ask(team, "down"))
        assert e["status"] == "ok" and engine_of(e) == other, e

    # 4. The supervisor restarts it: a new pid, a warning, the restart counter; its circuit closes when it answers.
    wait_for("the restart", lambda: out.engines()[victim_index][0] != victim_pid, 15)
    log = out.read()
    assert re.search(rf'"engine_exited".*"upstream": ?"{victim}"|"upstream": ?"{victim}".*"engine_exited"', log), log
    assert '"status": -9' in log or '"status":-9' in log, log
    gw_metrics = httpx.get(served.url + "/metrics", timeout=5).text
    name = "tokenweir_gateway_engine_restarts_total"
    assert metric_value(gw_metrics, name, model=MODEL, upstream=victim) == 1.0, gw_metrics
    assert metric_value(gw_metrics, name, model=MODEL, upstream=other) in (None, 0.0)
    state = "tokenweir_gateway_upstream_circuit_state"

    def closed() -> bool:
        text = httpx.get(served.url + "/metrics", timeout=5).text
        return metric_value(text, state, model=MODEL, upstream=victim) == 0.0

    assert not closed()  # open while it is down
    wait_for("the restarted engine's circuit to close", closed, 120, every_s=0.5)
    back_after = time.monotonic() - killed_at

    # 5. It takes traffic again: a burst the other engine cannot take alone (bounded load) spreads onto it.
    with ThreadPoolExecutor(8) as pool:
        rids = list(pool.map(lambda i: ask(TEAMS[i % 4], "after", max_tokens=8), range(8)))
    after = [event(rid) for rid in rids]
    assert all(e["status"] == "ok" for e in after), after
    assert victim in {engine_of(e) for e in after}, after
    print(f"engine back after {back_after:.1f}s; test body {time.monotonic() - t_start:.1f}s")
