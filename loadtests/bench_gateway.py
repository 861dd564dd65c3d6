"""Gateway overhead benchmark: the fake upstream direct vs through the gateway (all admission on).

    .venv/bin/python loadtests/bench_gateway.py [--requests 400] [--concurrency 1 8 32]

Three processes: the fake upstream, the gateway (one uvicorn worker; auth, caps, reservation, team semaphore,
priority queue, JSONL events and metrics all on), and this client. For each mode (non-stream, stream of 20
chunks) and concurrency it prints req/s, p50/p99 latency direct and through the gateway, the added p50/p99,
and the gateway's CPU-ms per request (utime+stime from /proc/<pid>/stat over the run). Not a test: numbers
depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: make `gateway`, `loadtests` importable
MODEL = "fake-model"
PROMPT = [{"role": "user", "content": "Benchmark the gateway overhead with a short prompt."}]


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def run_gateway(upstream_url: str, port: int, workdir: str, key_file: str) -> None:
    """The gateway process: a store with one fully-limited team, then uvicorn (one worker)."""
    import uvicorn

    from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
    from tokenweir.gateway.server.app import create_app
    from tokenweir.gateway.store.store import Store
    from tokenweir.policies.limits import TeamLimits

    store = Store.open(f"sqlite:///{workdir}/bench.db")
    limits = TeamLimits(
        rpm=10_000_000,
        tpm=10_000_000_000,
        tokens_per_day=10**12,
        tokens_per_month=10**13,
        max_concurrency=10_000,
        max_prompt_tokens=4096,
        max_output_tokens=256,
    )
    team = store.create_team("bench", limits)
    secret, _ = store.create_key(team.id, "bench")
    Path(key_file).write_text(secret)
    config = GatewayConfig(
        port=port,
        pools=[PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream_url)], capacity=256, max_queued=10_000)],
        events=EventsConfig(path=f"{workdir}/events.jsonl"),
        log_level="warning",
    )
    app = create_app(config, store=store)
    # uvicorn re-raises SIGTERM after its graceful shutdown: turn it into SystemExit so `finally` runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    profile = os.environ.get("BENCH_PROFILE")  # a path: cProfile the gateway process into it
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    finally:
        if profiler:
            profiler.disable()
            profiler.dump_stats(profile)


async def load(url: str, headers: dict, body: dict, stream: bool, concurrency: int, n: int) -> tuple[list, float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    latencies: list[float] = []
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        todo = iter(range(n))

        async def worker() -> None:
            for _ in todo:
                t0 = time.perf_counter()
                if stream:
                    async with client.stream("POST", url, json=body, headers=headers) as r:
                        async for _ in r.aiter_raw():
                            pass
                        assert r.status_code == 200, r.status_code
                else:
                    r = await client.post(url, json=body, headers=headers)
                    assert r.status_code == 200, r.text
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] * 1000 if len(xs) > 1 else xs[0] * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400, help="per cell (after a warm-up)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--mode", choices=["both", "non-stream", "stream"], default="both")
    p.add_argument("--gateway", nargs=4, help=argparse.SUPPRESS)  # internal: run the gateway process
    args = p.parse_args()
    if args.gateway:
        return run_gateway(args.gateway[0], int(args.gateway[1]), args.gateway[2], args.gateway[3])

    from loadtests.fake_upstream import free_port

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up_port, gw_port = free_port(), free_port()
    work = tempfile.mkdtemp(prefix="twbench-")
    key_file = f"{work}/key"
    procs = [
        subprocess.Popen([sys.executable, "-m", "loadtests.fake_upstream", "--port", str(up_port)], env=env),
    ]
    upstream = f"http://127.0.0.1:{up_port}"
    try:
        wait_http(upstream + "/health")
        gw = subprocess.Popen(
            [sys.executable, __file__, "--gateway", upstream, str(gw_port), work, key_file], env=env, cwd=ROOT
        )
        procs.append(gw)
        gateway = f"http://127.0.0.1:{gw_port}"
        wait_http(gateway + "/health")
        key = Path(key_file).read_text()
        print(f"fake upstream {upstream}, gateway {gateway} (pid {gw.pid}), {args.requests} requests per cell")
        header = (
            f"{'mode':<10} {'conc':>4} | {'direct r/s':>10} {'p50':>7} {'p99':>7} | {'gw r/s':>8} {'p50':>7} "
            f"{'p99':>7} | {'added p50':>9} {'p99':>7} | gw CPU-ms/req (user+sys)"
        )
        print(header + "\n" + "-" * len(header))
        for stream in {"both": (False, True), "non-stream": (False,), "stream": (True,)}[args.mode]:
            body = {"model": MODEL, "messages": PROMPT, "max_tokens": 20, "stream": stream, "fake": {"tokens": 20}}
            for conc in args.concurrency:
                direct_url = upstream + "/v1/chat/completions"
                gw_url = gateway + "/v1/chat/completions"
                auth = {"authorization": f"Bearer {key}"}
                asyncio.run(load(direct_url, {}, body, stream, conc, 50))
                asyncio.run(load(gw_url, auth, body, stream, conc, 50))  # warm: connections, caches
                d_lat, d_wall = asyncio.run(load(direct_url, {}, body, stream, conc, args.requests))
                cpu0 = cpu_seconds(gw.pid)
                g_lat, g_wall = asyncio.run(load(gw_url, auth, body, stream, conc, args.requests))
                cpu1 = cpu_seconds(gw.pid)
                user_ms, sys_ms = ((b - a) * 1000 / args.requests for a, b in zip(cpu0, cpu1, strict=True))
                d50, d99, g50, g99 = pct(d_lat, 50), pct(d_lat, 99), pct(g_lat, 50), pct(g_lat, 99)
                print(
                    f"{'stream' if stream else 'non-stream':<10} {conc:>4} | {args.requests / d_wall:>10.0f} "
                    f"{d50:>7.2f} {d99:>7.2f} | {args.requests / g_wall:>8.0f} {g50:>7.2f} {g99:>7.2f} | "
                    f"{g50 - d50:>9.2f} {g99 - d99:>7.2f} | {user_ms + sys_ms:>6.2f} ({user_ms:.2f}+{sys_ms:.2f})",
                    flush=True,
                )
        print("ms; added = through the gateway minus direct; CPU: /proc/<gateway pid>/stat utime+stime")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
