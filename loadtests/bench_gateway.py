"""Gateway overhead benchmark: the gateway's CPU per request and its added latency, and two commits compared.

    .venv/bin/python loadtests/bench_gateway.py                         # every cell, 400 requests, 2 rounds
    .venv/bin/python loadtests/bench_gateway.py --cells non-stream-1 stream-32 --requests 1000 --rounds 3
    .venv/bin/python loadtests/bench_gateway.py --compare HEAD~3 --plot /tmp/bench.png --json /tmp/bench.json
    BENCH_PROFILE=/tmp/gw.prof .venv/bin/python loadtests/bench_gateway.py --cells non-stream-32
        # then python -m pstats /tmp/gw.prof (the current in-memory gateway; others: /tmp/gw.prof.<side>-<state>)

Processes: the fake upstream (loadtests/fake_upstream.py), a gateway per side and state backend
(loadtests/bench_gateway_runner.py: one worker, `serve`'s own HTTP server where the commit has one; one team with
rpm, tpm, daily and monthly token budgets, max_concurrency and prompt/output caps and its API key, so every
admission step runs; JSONL events and metrics on), and this client (httpx). State in memory, or for the redis-*
cells in Redis (state_url, a fresh key prefix per gateway whose keys are deleted afterwards).

The redis-capped-* cells are redis-non-stream-1/-32 through a gateway whose upstream has max_parallel_requests (never
reached): what the member's concurrency lease in Redis adds. The redis cells also print Redis's commands and CPU per
request (INFO commandstats and cpu, before and after the run).

The shadow-* cells are non-stream-1/-32 through a gateway whose pool mirrors 5% of its requests to a shadow pool
(a second fake upstream): "shadow vs none" prints what mirroring adds to the client's p50 and to the gateway's CPU.

Per cell (non-stream, or a stream of 20 chunks; 1 or 32 concurrent clients) and round: req/s and p50/p99
latency of the fake upstream direct, then through each side's gateway (each after a short warm-up); the added
p50 (gateway minus direct, same round); the gateway's CPU-ms per request (utime+stime of its process from
/proc/<pid>/stat over the run, divided by the requests). The summary gives the medians over the rounds.

--compare REF: the same for REF's gateway code (a `git worktree` of it, imported through a link tree so that the
editable install cannot slip the current code in: each runner prints where its gateway came from and refuses to
start otherwise), with the same venv, upstream and client, interleaved per cell and round (direct, current, REF,
direct, current, REF, ...), and the ratio current/REF of CPU-ms/req. "current" is the working tree as it is,
uncommitted edits included.

Not a test: the numbers depend on the machine and on whatever else runs on it (the client, the upstream and the
gateways share its cores; BENCH_PROFILE makes the profiled gateway many times slower). Compare sides within one
run, with rounds, never against an old printout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: make `loadtests` importable

from loadtests.bench_gateway_runner import MODEL, checkout_ref, git, remove_checkout  # noqa: E402
from loadtests.fake_upstream import free_port  # noqa: E402

RUNNER = Path(__file__).with_name("bench_gateway_runner.py")
REDIS_URL = "redis://127.0.0.1:6379/0"
CHAT = "/v1/chat/completions"
PROMPT = [{"role": "user", "content": "Benchmark the gateway overhead with a short prompt."}]


@dataclass(frozen=True)
class Cell:
    stream: bool
    concurrency: int
    state: str  # the gateway's limits state: "memory" (in-process) or "redis" (state_url)
    shadow: bool = False  # SHADOW_FRACTION of the requests mirrored to a second fake upstream (a shadow pool)
    capped: bool = False  # the upstream a pool member with max_parallel_requests (a lease per request, in Redis)

    @property
    def group(self) -> str:
        """The gateway that serves the cell: one per state, one with shadow traffic on, one with a capped member."""
        return self.state + ("-shadow" if self.shadow else "") + ("-capped" if self.capped else "")


SHADOW_FRACTION = 0.05
CELLS = {
    "non-stream-1": Cell(False, 1, "memory"),
    "non-stream-32": Cell(False, 32, "memory"),
    "stream-1": Cell(True, 1, "memory"),
    "stream-32": Cell(True, 32, "memory"),
    "redis-non-stream-1": Cell(False, 1, "redis"),
    "redis-non-stream-32": Cell(False, 32, "redis"),
    # the same as non-stream-1/-32 with 5% mirrored: "shadow vs none" compares their added p50
    "shadow-non-stream-1": Cell(False, 1, "memory", shadow=True),
    "shadow-non-stream-32": Cell(False, 32, "memory", shadow=True),
    # the same as redis-non-stream-1/-32 with the member's concurrency leased in Redis (MEMBER_CAP: never full here)
    "redis-capped-non-stream-1": Cell(False, 1, "redis", capped=True),
    "redis-capped-non-stream-32": Cell(False, 32, "redis", capped=True),
}
MEMBER_CAP = 64


@dataclass
class Side:
    name: str  # what the tables call it: "current" or the REF as given
    tag: str  # what files and the JSON call it: "current" or "ref"
    code_root: Path
    commit: str
    pythonpath: list[str]
    gateways: dict[str, dict[str, str]] = field(default_factory=dict)  # state -> what its runner imported


@dataclass
class Gateway:
    proc: subprocess.Popen
    url: str
    key: str = ""
    redis_prefix: str | None = None


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until `url` answers below 500 (the gateway's /health is 503 until its state is seeded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pid {proc.pid} exited with {proc.returncode} before {url} came up (its output above)")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout:.0f} s")


def redis_keys(prefix: str) -> list[str]:
    import redis

    with redis.Redis.from_url(REDIS_URL) as r:
        return [k.decode() for k in r.scan_iter(match=f"{prefix}:*", count=1000)]


def delete_redis_keys(prefix: str) -> int:
    """Deletes the keys under `prefix` (a fresh random one, checked unused before its gateway started)."""
    import redis

    keys = redis_keys(prefix)
    with redis.Redis.from_url(REDIS_URL) as r:
        for i in range(0, len(keys), 500):
            r.delete(*keys[i : i + 500])
    return len(keys)


def start_gateway(
    side: Side, group: str, upstream: str, work: Path, profile: str | None, shadow_upstream: str | None = None
) -> Gateway:
    """The side's gateway for a cell group, verified: its runner checked where the code came from; one request is
    served."""
    state = group.split("-")[0]
    gwdir = work / f"{side.tag}-{group}"
    gwdir.mkdir()
    port = free_port()
    cmd = [sys.executable, str(RUNNER), "--code-root", str(side.code_root), "--upstream", upstream]
    cmd += ["--port", str(port), "--workdir", str(gwdir), "--info", str(gwdir / "info.json"), "--label", side.name]
    prefix = f"twbench-{secrets.token_hex(6)}" if state == "redis" else None
    if prefix:
        if redis_keys(prefix):
            raise RuntimeError(f"Redis already holds keys under {prefix}: not fresh")
        cmd += ["--state-url", REDIS_URL, "--redis-prefix", prefix]
    if group.endswith("-capped"):
        cmd += ["--member-cap", str(MEMBER_CAP)]
    if group.endswith("-shadow"):
        assert shadow_upstream is not None
        cmd += ["--shadow-upstream", shadow_upstream, "--shadow-fraction", str(SHADOW_FRACTION)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BENCH_PROFILE")}
    if side.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(side.pythonpath)
    if profile:
        plain = side.tag == "current" and state == "memory"
        env["BENCH_PROFILE"] = profile if plain and group == state else f"{profile}.{side.tag}-{group}"
    gw = Gateway(subprocess.Popen(cmd, env=env, cwd=gwdir), f"http://127.0.0.1:{port}", redis_prefix=prefix)
    try:
        wait_http(gw.url + "/health", gw.proc)
        info = json.loads((gwdir / "info.json").read_text())
        gw.key = info.pop("key")
        side.gateways[group] = info
        asyncio.run(load(gw.url + CHAT, {"authorization": f"Bearer {gw.key}"}, CELLS["non-stream-1"], 1))
        if prefix and not redis_keys(prefix):
            raise RuntimeError(f"{side.name}: a request was served but Redis holds nothing under {prefix}")
    except BaseException:
        stop_gateway(gw)
        raise
    return gw


def stop_gateway(gw: Gateway) -> None:
    gw.proc.terminate()
    try:
        gw.proc.wait(timeout=45)  # serve's server waits up to shutdown_grace_s for requests in flight
    except subprocess.TimeoutExpired:
        gw.proc.kill()
        gw.proc.wait()
    if gw.redis_prefix:
        print(f"deleted {delete_redis_keys(gw.redis_prefix)} Redis keys under {gw.redis_prefix}", flush=True)


async def load(url: str, headers: dict[str, str], cell: Cell, n: int) -> tuple[list[float], float]:
    """`n` requests from `cell.concurrency` clients: (latencies in s, wall time in s)."""
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 20, "stream": cell.stream, "fake": {"tokens": 20}}
    limits = httpx.Limits(max_connections=cell.concurrency, max_keepalive_connections=cell.concurrency)
    latencies: list[float] = []
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        todo = iter(range(n))

        async def worker() -> None:
            for _ in todo:
                t0 = time.perf_counter()
                if cell.stream:
                    async with client.stream("POST", url, json=body, headers=headers) as r:
                        async for _ in r.aiter_raw():
                            pass
                        assert r.status_code == 200, r.status_code
                else:
                    r = await client.post(url, json=body, headers=headers)
                    assert r.status_code == 200, r.text
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(cell.concurrency)))
        return latencies, time.perf_counter() - t0


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] * 1000 if len(xs) > 1 else xs[0] * 1000


def redis_counters() -> tuple[int, int, float]:
    """The Redis server's scripts run so far (EVALSHA, EVAL), its commands (every kind, those scripts call included)
    and its CPU seconds (user + sys)."""
    import redis

    with redis.Redis.from_url(REDIS_URL) as r:
        stats = r.info("commandstats")
        cpu = r.info("cpu")
    scripts = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))
    calls = sum(int(v["calls"]) for v in stats.values())
    return scripts, calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def measure(url: str, headers: dict[str, str], cell: Cell, n: int, pid: int | None = None) -> dict[str, float]:
    """One run after a warm-up; with `pid`, that process's CPU over the run; in a redis cell, Redis's commands and CPU
    per request over the run (the gateway's background calls included: lease renewals, the epoch watch, the prefix
    index's sync; and this bench's own handful of INFO and CLIENT calls, ~0.01 a request at 600 requests)."""
    asyncio.run(load(url, headers, cell, max(20, 2 * cell.concurrency)))  # connections, the gateway's caches
    cpu0 = cpu_seconds(pid) if pid else (0.0, 0.0)
    redis0 = redis_counters() if pid and cell.state == "redis" else None
    latencies, wall = asyncio.run(load(url, headers, cell, n))
    result = {"rps": n / wall, "p50_ms": pct(latencies, 50), "p99_ms": pct(latencies, 99)}
    if pid:
        user, system = ((b - a) * 1000 / n for a, b in zip(cpu0, cpu_seconds(pid), strict=True))
        result |= {"cpu_ms": user + system, "user_ms": user, "sys_ms": system}
    if redis0 is not None:
        scripts, calls, cpu = (b - a for a, b in zip(redis0, redis_counters(), strict=True))
        result |= {"redis_scripts": scripts / n, "redis_ops": calls / n, "redis_cpu_ms": cpu * 1000 / n}
    return result


def run_cell(name: str, rounds: int, n: int, upstream: str, sides: list[Side], gws: dict[str, Gateway]) -> list:
    """Rounds of direct, then each side in turn: drift on the machine hits every side alike."""
    cell, records = CELLS[name], []
    for rnd in range(1, rounds + 1):
        direct = measure(upstream + CHAT, {}, cell, n)
        records.append({"cell": name, "round": rnd, "side": "direct", **direct})
        progress(name, rnd, "direct", direct)
        for side in sides:
            gw = gws[side.tag]
            m = measure(gw.url + CHAT, {"authorization": f"Bearer {gw.key}"}, cell, n, gw.proc.pid)
            m["added_p50_ms"] = m["p50_ms"] - direct["p50_ms"]
            records.append({"cell": name, "round": rnd, "side": side.tag, **m})
            progress(name, rnd, side.name, m)
    return records


def progress(cell: str, rnd: int, side: str, m: dict[str, float]) -> None:
    line = f"{cell:<20} r{rnd} {side[:12]:<12} {m['rps']:>7.0f} r/s  p50 {m['p50_ms']:>7.2f}  p99 {m['p99_ms']:>7.2f}"
    if "cpu_ms" in m:
        line += f"  added p50 {m['added_p50_ms']:>6.2f}  CPU-ms/req {m['cpu_ms']:>6.3f}"
        line += f" ({m['user_ms']:.3f}+{m['sys_ms']:.3f})"
    if "redis_ops" in m:
        line += f"  Redis/req: {m['redis_scripts']:.2f} scripts, {m['redis_ops']:.1f} commands, "
        line += f"{m['redis_cpu_ms']:.3f} CPU-ms"
    print(line, flush=True)


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """cell -> side (direct, current, ref) -> the median over the rounds of each number."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in records:
        out.setdefault(r["cell"], {}).setdefault(r["side"], {})
    for cell, sides in out.items():
        for side in sides:
            rows = [r for r in records if r["cell"] == cell and r["side"] == side]
            keys = [k for k in rows[0] if k not in ("cell", "round", "side")]
            sides[side] = {k: statistics.median(r[k] for r in rows) for k in keys}
    return out


def print_summary(summary: dict[str, dict[str, dict[str, float]]], sides: list[Side], rounds: int) -> None:
    print(f"\nsummary: medians of {rounds} round(s); ms; added = through the gateway minus direct, same round")
    if len(sides) == 1:
        header = (
            f"{'cell':<20} | {'direct r/s':>10} {'p50':>7} {'p99':>7} | {'gw r/s':>8} {'p50':>7} {'p99':>7} | "
            f"{'added p50':>9} | gw CPU-ms/req (user+sys)"
        )
        print(header + "\n" + "-" * len(header))
        for cell, by in summary.items():
            d, g = by["direct"], by["current"]
            print(
                f"{cell:<20} | {d['rps']:>10.0f} {d['p50_ms']:>7.2f} {d['p99_ms']:>7.2f} | {g['rps']:>8.0f} "
                f"{g['p50_ms']:>7.2f} {g['p99_ms']:>7.2f} | {g['added_p50_ms']:>9.2f} | "
                f"{g['cpu_ms']:>6.3f} ({g['user_ms']:.3f}+{g['sys_ms']:.3f})"
            )
        return
    ref = sides[1].name[:10]
    header = (
        f"{'cell':<20} | CPU-ms/req {'current':>8} {ref:>10} {'cur/ref':>7} | added p50 {'current':>8} {ref:>10} | "
        f"gw r/s {'current':>8} {ref:>10} | {'direct p50':>10}"
    )
    print(header + "\n" + "-" * len(header))
    for cell, by in summary.items():
        c, r, d = by["current"], by["ref"], by["direct"]
        ratio = c["cpu_ms"] / r["cpu_ms"] if r["cpu_ms"] else float("nan")
        print(
            f"{cell:<20} | {'':10} {c['cpu_ms']:>8.3f} {r['cpu_ms']:>10.3f} {ratio:>7.2f} | {'':9} "
            f"{c['added_p50_ms']:>8.2f} {r['added_p50_ms']:>10.2f} | {'':6} {c['rps']:>8.0f} {r['rps']:>10.0f} | "
            f"{d['p50_ms']:>10.2f}"
        )


def print_redis(summary: dict[str, dict[str, dict[str, float]]], sides: list[Side]) -> None:
    """What each request cost the Redis server, per redis cell and side (medians over the rounds)."""
    rows = [(cell, side, by[side.tag]) for cell, by in summary.items() for side in sides if "redis_ops" in by[side.tag]]
    if rows:
        print("\nRedis per request (scripts run; commands of every kind, the scripts' own included; CPU): medians")
    for cell, side, m in rows:
        print(
            f"  {cell:<27} {side.name:<10} {m['redis_scripts']:>5.2f} scripts  {m['redis_ops']:>6.1f} commands  "
            f"{m['redis_cpu_ms']:.3f} CPU-ms"
        )


def shadow_ok(url: str) -> float:
    """Mirrored requests the gateway counted as answered by the shadow pool."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tokenweir_gateway_shadow_requests_total{") and 'status="ok"' in line
    )


def print_shadow(summary: dict[str, dict[str, dict[str, float]]], sides: list[Side], mirrored: dict) -> None:
    """Shadow traffic's cost to the client: the added p50 with SHADOW_FRACTION mirrored minus without, same side."""
    pairs = [(c, c.removeprefix("shadow-")) for c in summary if c.startswith("shadow-") and c[7:] in summary]
    if not pairs:
        return
    print(f"\nshadow traffic ({SHADOW_FRACTION:.0%} mirrored) vs none: added p50, ms (medians; the same gateway code)")
    for side in sides:
        for shadow, plain in pairs:
            with_, without = summary[shadow][side.tag]["added_p50_ms"], summary[plain][side.tag]["added_p50_ms"]
            print(
                f"  {side.name:<10} {plain:<16} none {without:>6.2f}  shadow {with_:>6.2f}  "
                f"delta {with_ - without:>+6.2f}  CPU-ms/req {summary[plain][side.tag]['cpu_ms']:.3f} -> "
                f"{summary[shadow][side.tag]['cpu_ms']:.3f}"
            )
        print(f"  {side.name:<10} mirrored and answered: {mirrored.get(side.tag, 0):.0f}")


def plot(path: str, summary: dict[str, dict[str, dict[str, float]]], sides: list[Side], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(summary)
    width = 0.8 / len(sides)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cells)), 4.5))
    for i, side in enumerate(sides):
        xs = [x + (i - (len(sides) - 1) / 2) * width for x in range(len(cells))]
        values = [summary[c][side.tag]["cpu_ms"] for c in cells]
        bars = ax.bar(xs, values, width, label=f"{side.name} ({side.commit})")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(cells)), cells, rotation=20, ha="right")
    ax.set_ylabel("gateway CPU-ms / request (user+sys)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"plot: {path}")


def current_commit() -> str:
    """HEAD, marked +dirty when the packages the gateway runs have uncommitted edits (they are measured too)."""
    dirty = git(ROOT, "status", "--porcelain", "--", "gateway", "policies", "common")
    return git(ROOT, "rev-parse", "--short=12", "HEAD") + ("+dirty" if dirty else "")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", choices=list(CELLS), default=list(CELLS), help="default: all")
    p.add_argument("--requests", type=int, default=400, help="per cell, side and round (after a warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved runs per cell; the medians are reported")
    p.add_argument("--compare", metavar="REF", help="a git commit-ish whose gateway runs against the current one")
    p.add_argument("--plot", metavar="PATH", help="a bar chart of CPU-ms/req per cell (PNG, SVG, ...)")
    p.add_argument("--json", metavar="PATH", help="the raw numbers of every run, and the summary")
    args = p.parse_args()
    if args.requests < 2 or args.rounds < 1:
        p.error("--requests >= 2 and --rounds >= 1")
    return args


def main() -> None:
    args = parse_args()
    profile = os.environ.get("BENCH_PROFILE")
    work = Path(tempfile.mkdtemp(prefix="twbench-"))
    ref_tmp = work / "ref"
    sides = [Side("current", "current", ROOT, current_commit(), [])]
    procs: list[subprocess.Popen] = []
    try:
        if args.compare:
            sha, tree, path = checkout_ref(ROOT, args.compare, ref_tmp)
            sides.append(Side(args.compare, "ref", tree, sha[:12], path))
        up_port = free_port()
        cmd = [sys.executable, "-m", "loadtests.fake_upstream", "--port", str(up_port)]
        procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT))
        upstream = f"http://127.0.0.1:{up_port}"
        wait_http(upstream + "/health", procs[0])
        shadow_upstream = None
        if any(CELLS[n].shadow for n in args.cells):  # mirrors go to a fake of their own, as to another model
            shadow_port = free_port()
            cmd = [sys.executable, "-m", "loadtests.fake_upstream", "--port", str(shadow_port)]
            procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT))
            shadow_upstream = f"http://127.0.0.1:{shadow_port}"
            wait_http(shadow_upstream + "/health", procs[-1])
        for side in sides:
            print(f"side {side.name}: {side.commit} at {side.code_root}, PYTHONPATH={side.pythonpath or '(none)'}")
        print(f"{args.requests} requests per cell, side and round; {args.rounds} round(s); cells: {args.cells}")
        records: list[dict[str, Any]] = []
        mirrored: dict[str, float] = {}
        for group in ("memory", "redis", "memory-shadow", "redis-capped"):
            names = [n for n in args.cells if CELLS[n].group == group]
            gateways: dict[str, Gateway] = {}
            try:
                for side in sides if names else []:
                    gateways[side.tag] = start_gateway(side, group, upstream, work, profile, shadow_upstream)
                for name in names:
                    records += run_cell(name, args.rounds, args.requests, upstream, sides, gateways)
                if group.endswith("-shadow"):
                    mirrored = {tag: shadow_ok(gw.url) for tag, gw in gateways.items()}
            finally:
                for gw in gateways.values():
                    stop_gateway(gw)
        summary = summarize(records)
        print_summary(summary, sides, args.rounds)
        print_redis(summary, sides)
        print_shadow(summary, sides, mirrored)
        tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
        print(
            f"CPU: /proc/<gateway pid>/stat utime+stime over the run / requests, counted in {tick_ms:g} ms clock ticks "
            f"(a resolution of {tick_ms / args.requests:.3f} ms/req here); noisy machine: compare within one run"
        )
        title = f"gateway CPU per request, {args.requests} requests x {args.rounds} round(s), medians"
        if args.plot:
            plot(args.plot, summary, sides, title)
        if args.json:
            meta = {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg(), "time": time.time()}
            sides_out = [{k: str(v) if isinstance(v, Path) else v for k, v in vars(s).items()} for s in sides]
            out = {"args": vars(args), "machine": meta, "sides": sides_out, "records": records, "summary": summary}
            Path(args.json).write_text(json.dumps(out, indent=1))
            print(f"json: {args.json}")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
        if (ref_tmp / "worktree").exists():
            remove_checkout(ROOT, ref_tmp / "worktree")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
