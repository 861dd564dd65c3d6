"""Prefix-cache-aware routing against load-only routing, on the real thing: `tokenweir serve --engines 2` (SmolLM2,
one torch thread per engine) under a seeded multi-tenant chat workload, once per route strategy, each on a fresh
`serve` (caches start cold), plus a reference: one engine whose KV pool is both engines' together.

    .venv/bin/python loadtests/bench_routing.py            # 4-7 min on 2 cores
    .venv/bin/python loadtests/bench_routing.py --quick    # 2-4 min
    .venv/bin/python loadtests/bench_routing.py --gateways 2   # through `serve --workers 2` on Redis

Workload: 8 teams, each with a distinct ~512-token system prompt; conversations of 1-3 turns (a later turn resends
the history, the model's earlier answers included) with short user turns and 8-24 output tokens, greedy, streamed
(`stream_options.include_usage`), `--concurrency` conversations at a time (closed loop), in one seeded order that
every phase replays. Per phase: the engines' own prefix-cache hit rate (hit / looked-up prompt tokens, deltas of their
/metrics), TTFT p50/p99 at the client, output tokens per second of wall time, requests per instance (from the
gateway's events) and max/min, and the prefix route's reasons (hit, home, spill). The table goes to stdout and
loadtests/results/bench_routing.md, a plot to loadtests/results/bench_routing.png; the targets are checked, not
assumed.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
REDIS_URL = "redis://127.0.0.1:6379/0"
TEAMS = ("Aurora", "Basalt", "Cobalt", "Dune", "Ember", "Fjord", "Garnet", "Helix")
TOPICS = ("billing", "deployments", "on-call", "security", "hiring", "travel", "metrics", "backups", "onboarding")
QUESTIONS = ("What should I check first?", "Summarise that in one line.", "Any risks?", "Who owns this?")
HITS, QUERIES = "tokenweir:prefix_cache_hits_total", "tokenweir:prefix_cache_queries_total"
PHASES = (("prefix", 2), ("least_loaded", 2), ("round_robin", 2), ("single engine", 1))


# --workload preamble: every team's system prompt opens with these words (with the chat template's header, the first
# two 16-token blocks are the same for all teams), as a company's do
PREAMBLE = "You are an assistant at Example Corp, a company that builds software for shops, and you work for a team."


def system_prompt(team: str, preamble: bool = False) -> str:
    """~512 tokens: distinct from the first words on, or (`preamble`) after a preamble every team shares."""
    rules = " ".join(
        f"Rule {i} of team {team}: for {TOPICS[i % len(TOPICS)]}, answer briefly and precisely." for i in range(29)
    )
    own = f"{team} {team} {team}. You are the internal assistant of team {team}. {rules}"
    return f"{PREAMBLE} {own}" if preamble else own


@dataclass(slots=True)
class Conversation:
    team: str
    questions: list[str]
    max_tokens: list[int]
    system: str = ""


def make_workload(seed: int, conversations: int, preamble: bool = False) -> list[Conversation]:
    """Seeded: teams evenly interleaved in a random order; 1 turn (50%), 2 (30%) or 3 (20%)."""
    rng = random.Random(seed)
    teams = [TEAMS[i % len(TEAMS)] for i in range(conversations)]
    rng.shuffle(teams)
    work = []
    for team in teams:
        turns = rng.choices((1, 2, 3), weights=(5, 3, 2))[0]
        first = f"I have a question about {rng.choice(TOPICS)} (ticket {rng.randrange(1000, 9999)})."
        questions = [first, *rng.sample(QUESTIONS, turns - 1)]
        tokens = [rng.randrange(8, 25) for _ in range(turns)]
        work.append(Conversation(team, questions, tokens, system_prompt(team, preamble)))
    return work


@dataclass(slots=True)
class Result:
    request_id: str
    team: str
    ttft_s: float
    output_tokens: int


@dataclass
class Phase:
    name: str
    engines: int
    kv_blocks: int
    wall_s: float = 0.0
    hits: float = 0.0
    queries: float = 0.0
    results: list[Result] = field(default_factory=list)
    per_instance: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    per_team: dict = field(default_factory=dict)  # team -> Counter of the engines that served it
    loadavg: float = 0.0  # the machine's 1-min load average as the phase ended (ours: ~2; more: other work)
    warm: int = 0  # requests whose system prompt came from the cache (>= 256 cached tokens, from the events)
    errors: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def ttft(self, q: float) -> float:
        xs = sorted(r.ttft_s for r in self.results)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    @property
    def tok_s(self) -> float:
        return sum(r.output_tokens for r in self.results) / self.wall_s if self.wall_s else 0.0

    @property
    def team_home(self) -> float:
        """The share of requests served by their team's most used engine."""
        total = sum(sum(c.values()) for c in self.per_team.values())
        return sum(c.most_common(1)[0][1] for c in self.per_team.values()) / total if total else 0.0

    @property
    def imbalance(self) -> float | None:
        if self.engines < 2:
            return None
        counts = [self.per_instance.get(f"engine-{i}", 0) for i in range(self.engines)]
        return max(counts) / min(counts) if min(counts) else float("inf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`tokenweir serve` as a child: its output drained by a thread, its engines' URLs and the demo key read off it."""

    def __init__(self, config_path: Path, engines: int, store: Path, gateways: int = 1) -> None:
        self.port = free_port()
        args = ["serve", "--config", str(config_path), "--port", str(self.port), "--engine-port", str(free_port())]
        args += ["--engines", str(engines), "--store", f"sqlite:///{store}", "--workers", str(gateways)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenweir.gateway.process.cli", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.text, self.lock = "", threading.Lock()
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"

    def _drain(self) -> None:
        for line in self.proc.stdout:
            with self.lock:
                self.text += line

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"serve exited with {self.proc.returncode}:\n{self.text}")
            if "gateway on" in self.text:
                try:
                    if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.25)
        sys.exit(f"serve did not become ready in {timeout_s:g}s:\n{self.text}")

    def engine_urls(self) -> list[str]:
        urls = dict(re.findall(r"engine (\d+) \(pid \d+\) starting on (http://\S+)", self.text))
        if urls:
            return [urls[k] for k in sorted(urls, key=int)]
        return re.findall(r"engine ready on (http://\S+)", self.text)

    def admin_key(self) -> str:
        return re.search(r"bootstrap ADMIN key .*: (tw-\S+)", self.text).group(1)

    def team_keys(self, limits: dict[str, dict] | None = None) -> dict[str, str]:
        """A team of the gateway's own, with a key, per workload team (TEAMS, or the teams `limits` names, each made
        with its limits): the gateway scopes each team's prefix cache (its pool's cache_scope) by the team the key
        belongs to."""
        admin = {"authorization": f"Bearer {self.admin_key()}"}
        keys = {}
        for name, team_limits in (limits or dict.fromkeys(TEAMS, {})).items():
            team = {"name": name, "limits": team_limits}
            r = httpx.post(self.url + "/admin/teams", json=team, headers=admin, timeout=10)
            r.raise_for_status()
            r = httpx.post(f"{self.url}/admin/teams/{r.json()['id']}/keys", json={"name": "bench"}, headers=admin)
            r.raise_for_status()
            keys[name] = r.json()["secret"]
        return keys

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the gateway stops its engines on the way out
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def metric(text: str, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*model_name="{MODEL}"[^}}]*\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    texts = [httpx.get(u + "/metrics", timeout=5).text for u in urls]
    return sum(metric(t, HITS) for t in texts), sum(metric(t, QUERIES) for t in texts)


def converse(client: openai.OpenAI, phase: str, n: int, conv: Conversation) -> tuple[list[Result], int]:
    """One conversation, turn by turn, each streamed; the next turn resends the history with the answer."""
    messages = [{"role": "system", "content": conv.system}]
    results, errors = [], 0
    for turn, (question, max_tokens) in enumerate(zip(conv.questions, conv.max_tokens, strict=True)):
        messages.append({"role": "user", "content": question})
        rid = f"{phase.replace(' ', '_')}-{n}-{turn}"
        t0, ttft, text, usage = time.perf_counter(), None, [], None
        try:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"x-request-id": rid},
            )
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices and chunk.choices[0].delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(chunk.choices[0].delta.content)
        except openai.APIError as e:
            print(f"  {rid}: {type(e).__name__}: {e}", flush=True)
            errors += 1
            break
        answer = "".join(text)
        results.append(
            Result(rid, conv.team, ttft or time.perf_counter() - t0, usage.completion_tokens if usage else 0)
        )
        messages.append({"role": "assistant", "content": answer})
    return results, errors


def run_phase(
    phase: Phase, work: list[Conversation], concurrency: int, tmp: Path, gateways: int = 1, cache_scope: str = "team"
) -> Phase:
    strategy = "prefix" if phase.engines == 1 else phase.name
    tag = phase.name.replace(" ", "_")
    events_path = tmp / f"{tag}.events.jsonl"
    config: dict = {
        "events": {"path": str(events_path)},
        "load_poll_interval_s": 0.25,
        "engine": {
            "route": strategy,
            "cache_scope": cache_scope,
            "num_threads": 2,  # the machine's compute either way: 1 thread per engine of 2, 2 for the single one
            "extra_args": ["--quantization", "none", "--num-kv-blocks", str(phase.kv_blocks)],
        },
    }
    if gateways > 1:  # gateway processes sharing limits, member leases and the prefix index through Redis
        config["state_url"] = REDIS_URL
    config_path = tmp / f"{tag}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    t_start = time.monotonic()
    serve = Serve(config_path, phase.engines, tmp / f"{tag}.db", gateways)
    try:
        serve.wait_ready()
        start_s = time.monotonic() - t_start
        urls = serve.engine_urls()
        assert len(urls) == phase.engines, serve.text
        # with several gateway processes, a connection per request: each lands on whichever process accepts it
        http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) if gateways > 1 else None
        clients = {
            team: openai.OpenAI(base_url=serve.url + "/v1", api_key=key, max_retries=0, timeout=300, http_client=http)
            for team, key in serve.team_keys().items()
        }
        hits0, queries0 = prefix_counters(urls)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            done = list(pool.map(lambda nc: converse(clients[nc[1].team], phase.name, *nc), enumerate(work)))
        phase.wall_s = time.perf_counter() - t0
        phase.loadavg = os.getloadavg()[0]
        for client in clients.values():
            client.close()  # no idle keep-alive connections for the gateway's graceful shutdown to wait on
        hits1, queries1 = prefix_counters(urls)
        phase.hits, phase.queries = hits1 - hits0, queries1 - queries0
        phase.results = [r for rs, _ in done for r in rs]
        phase.errors = sum(e for _, e in done)
        time.sleep(1.0)  # the last events' lines
        wanted = {r.request_id for r in phase.results}
        paths = [events_path] if gateways == 1 else [tmp / f"{tag}.events.w{w}.jsonl" for w in range(gateways)]
        teams = {r.request_id: r.team for r in phase.results}
        for line in (line for path in paths for line in path.read_bytes().splitlines()):
            e = orjson.loads(line)
            if e.get("request_id") in wanted:
                instance = (e.get("instance") or "?").split("@", 1)[-1]
                phase.per_instance[instance if instance.startswith("engine-") else "engine"] += 1
                phase.per_team.setdefault(teams[e["request_id"]], Counter())[instance] += 1
                phase.reasons[(e.get("route_reason") or {}).get("reason")] += 1
                phase.warm += (e.get("cached_tokens") or 0) >= 256
    finally:
        t_stop = time.monotonic()
        serve.stop()
    stop_s = time.monotonic() - t_stop
    print(
        f"[{phase.name:>13}] {len(phase.results)} requests in {phase.wall_s:5.1f}s (start {start_s:.0f}s, stop "
        f"{stop_s:.0f}s): hit rate {phase.hit_rate:5.1%} ({phase.warm} warm), "
        f"TTFT p50 {phase.ttft(0.5) * 1000:6.0f} ms, load avg {phase.loadavg:.1f}, team on its engine "
        f"{phase.team_home:.0%}, "
        f"{phase.tok_s:5.1f} tok/s, per instance {dict(sorted(phase.per_instance.items()))}, "
        f"reasons {dict(phase.reasons)}" + (f", {phase.errors} errors" if phase.errors else ""),
        flush=True,
    )
    return phase


def table(phases: list[Phase]) -> str:
    rows = [
        "| route | hit rate | warm requests | TTFT p50 ms | TTFT p99 ms | output tok/s | per instance | max/min "
        "| team on its engine | route reasons | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in phases:
        per = ", ".join(f"{k}: {v}" for k, v in sorted(p.per_instance.items()))
        imb = "-" if p.imbalance is None else f"{p.imbalance:.2f}"
        reasons = ", ".join(f"{k} {v}" for k, v in p.reasons.most_common())
        rows.append(
            f"| {p.name} | {p.hit_rate:.1%} | {p.warm}/{len(p.results)} | {p.ttft(0.5) * 1000:.0f} "
            f"| {p.ttft(0.99) * 1000:.0f} | {p.tok_s:.1f} "
            f"| {per} | {imb} | {p.team_home:.0%} | {reasons} | {p.loadavg:.1f} |"
        )
    return "\n".join(rows)


def targets(phases: dict[str, Phase]) -> list[tuple[str, bool, str]]:
    pre, ll, single = phases["prefix"], phases["least_loaded"], phases["single engine"]
    ratio_hit = pre.hit_rate / single.hit_rate if single.hit_rate else float("inf")
    ratio_ttft = ll.ttft(0.5) / pre.ttft(0.5)
    return [
        ("prefix hit rate >= 90% of the single engine's", ratio_hit >= 0.9, f"{ratio_hit:.0%} of it"),
        ("prefix TTFT p50 >= 2x better than least_loaded", ratio_ttft >= 2, f"{ratio_ttft:.2f}x"),
        ("prefix output tok/s >= least_loaded's", pre.tok_s >= ll.tok_s, f"{pre.tok_s:.1f} vs {ll.tok_s:.1f}"),
        ("prefix max/min instance load <= 1.5", (pre.imbalance or 0) <= 1.5, f"{pre.imbalance:.2f}"),
        ("prefix: a team on one engine >= 90% of its requests", pre.team_home >= 0.9, f"{pre.team_home:.0%}"),
    ]


def plot(phases: list[Phase], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p.name for p in phases]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [p.hit_rate * 100 for p in phases], color="tab:green")
    axes[0].set_title("prefix-cache hit rate (%)")
    x = range(len(phases))
    axes[1].bar([i - 0.2 for i in x], [p.ttft(0.5) * 1000 for p in phases], 0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [p.ttft(0.99) * 1000 for p in phases], 0.4, label="p99")
    axes[1].set_xticks(list(x), names)
    axes[1].set_title("TTFT (ms, client side)")
    axes[1].legend()
    axes[2].bar(names, [p.tok_s for p in phases], color="tab:orange")
    axes[2].set_title("output tokens / s")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle("bench_routing: 2 engines (SmolLM2-135M, 1 thread each), 8 teams x ~512-token system prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer conversations (a smoke run)")
    ap.add_argument("--conversations", type=int, default=None, help="default 40, --quick 16")
    ap.add_argument("--concurrency", type=int, default=4, help="conversations at a time (default 4)")
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=128,
        help="KV blocks (16 tokens) per engine of the pair; the single engine gets twice. Default 128 (2048 tokens): "
        "the pair's cache together holds the 8 prompts (~33 blocks each) and one engine about half, as a pool "
        "serving many teams is sized; 192 gives each engine room for ~6 of the 8, where load-only routing stays "
        "mostly warm too",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--workload",
        choices=("distinct", "preamble"),
        default="distinct",
        help="preamble: every team's system prompt opens with the same words (written to bench_routing_preamble.*)",
    )
    ap.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateway processes (`serve --workers N`, sharing state, member leases and the prefix index through the "
        f"Redis at {REDIS_URL}); each request on a new connection, so either process may take it",
    )
    ap.add_argument(
        "--cache-scope",
        choices=("team", "shared"),
        default="team",
        help="the pool's cache_scope: team (the default: each team's prefix cache its own, as the gateway serves) or "
        "shared (teams' identical prefixes, e.g. a preamble, hit each other's cache); shared writes *_shared.*",
    )
    ap.add_argument(
        "--phases",
        default=",".join(name for name, _ in PHASES),
        help="the rows to run, comma-separated (default all; the targets need all)",
    )
    ap.add_argument("--out", type=Path, default=None, help="default loadtests/results/bench_routing[_preamble][_gwN]")
    args = ap.parse_args()
    preamble = args.workload == "preamble"
    stem = (
        ("bench_routing_preamble" if preamble else "bench_routing")
        + (f"_gw{args.gateways}" if args.gateways > 1 else "")
        + ("_shared" if args.cache_scope == "shared" else "")
    )
    if len(args.phases.split(",")) < len(PHASES):  # some rows only: written beside the whole table, not over it
        stem += "_" + "_".join(name.replace(" ", "-") for name in args.phases.split(","))
    args.out = args.out or ROOT / "loadtests" / "results" / stem
    n = args.conversations or (16 if args.quick else 40)
    work = make_workload(args.seed, n, preamble)
    turns = sum(len(c.questions) for c in work)
    print(
        f"bench_routing: {n} conversations ({turns} requests) of {len(TEAMS)} teams, {args.concurrency} at a time; "
        f"KV {args.kv_blocks} blocks per engine (single engine: {2 * args.kv_blocks})",
        flush=True,
    )
    phases: list[Phase] = []
    with tempfile.TemporaryDirectory(prefix="bench_routing_") as tmp:
        for name, engines in PHASES:
            if name not in args.phases.split(","):
                continue
            kv = args.kv_blocks * (2 if engines == 1 else 1)
            phase = Phase(name, engines, kv)
            phases.append(run_phase(phase, work, args.concurrency, Path(tmp), args.gateways, args.cache_scope))
    by_name = {p.name: p for p in phases}
    checks = targets(by_name) if len(by_name) == len(PHASES) else []
    md = [
        f"# bench_routing ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"`{' '.join(['loadtests/bench_routing.py', *sys.argv[1:]])}`: 2 engines x 1 torch thread (SmolLM2-135M, "
        f"dense), {n} seeded conversations ({turns} requests) of {len(TEAMS)} teams with ~512-token system prompts"
        f"{' opening with one shared preamble' if preamble else ''}, "
        f"{args.concurrency} at a time, streamed, each team with its own key, pool cache_scope {args.cache_scope}"
        f"{f', through {args.gateways} gateway processes on one Redis' if args.gateways > 1 else ''}; "
        f"KV {args.kv_blocks} blocks x 16 tokens per engine, the single "
        f"engine {2 * args.kv_blocks} (and 2 threads). Fresh `serve` per row. Warm requests: >= 256 prompt tokens "
        "from the cache. Load avg: the machine's 1-min load as the row ended (this run's own share is ~2; the cores "
        "are shared, so timings of rows with more are noisy).",
        "",
        table(phases),
        "",
        "| target | met | measured |",
        "|---|---|---|",
        *(f"| {what} | {'met' if ok else 'NOT met'} | {got} |" for what, ok, got in checks),
        "",
    ]
    text = "\n".join(md)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    plot(phases, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
