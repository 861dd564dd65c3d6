"""`tokenweir serve --engines 2` on SmolLM2 for tests: one stack's config and start (`engines_stack`), its output
read as it comes (which engine started with which pid and url), and what the two-engine tests share: the teams'
system prompts, waiting on a condition, reading Prometheus text, the engine an event names."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from loadtests.fake_upstream import free_port
from tests.support.serve_process import ServeProcess, serve_process

MODEL = "smollm2-135m"
TEAMS = ("Aurora", "Basalt", "Cobalt", "Dune")
STARTED = re.compile(r"engine (\d+) \(pid (\d+)\) starting on (http://\S+)")
# 16-token blocks: a team's prompt is ~29 of them; 80 hold two teams' prefixes and a request in flight, not four.
KV_BLOCKS = 80


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
    if b"tokenweir.engine.server" in cmdline:
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


@dataclass(slots=True)
class EnginesStack:
    served: ServeProcess
    out: Output
    events_path: Path

    def engine_urls(self) -> list[str]:
        engines = self.out.engines()
        return [engines[i][1] for i in sorted(engines)]


@contextmanager
def engines_stack(work: Path, route: str, prefill_engines: int = 0) -> Iterator[EnginesStack]:
    """`serve --engines 2` with the pool's `route` (`engine.route` in a config file), dense weights (no start-up
    int8 probe), one torch thread per engine, KV_BLOCKS per engine's pool, quick restarts and /load polls; stopped,
    engine children included, when the block ends. `prefill_engines` 1: engine 0 prefills, engine 1 decodes."""
    work.mkdir(parents=True, exist_ok=True)
    events_path = work / "events.jsonl"
    config = {
        "events": {"path": str(events_path)},
        "load_poll_interval_s": 0.25,
        "engine": {
            "route": route,
            "replicas": 2,
            "prefill_replicas": prefill_engines,
            "num_threads": 2,  # in all: one torch thread per engine child
            "restart_backoff_s": 0.2,
            "extra_args": ["--quantization", "none", "--num-kv-blocks", str(KV_BLOCKS)],
        },
    }
    config_path = work / "tokenweir.yaml"
    config_path.write_text(yaml.safe_dump(config))
    args = ["--config", str(config_path), "--port", str(free_port()), "--engine-port", str(free_port())]
    args += ["--engines", "2", "--store", f"sqlite:///{work / 'tw.db'}"]
    with serve_process(args, timeout_s=240) as served:
        out = Output(served.proc, served.output)
        try:
            assert sorted(out.engines()) == [0, 1], out.read()
            yield EnginesStack(served, out, events_path)
        finally:
            stop_serve(served, out)
