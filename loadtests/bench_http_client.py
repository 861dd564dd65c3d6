"""The upstream HTTP client's CPU per call, side by side: the gateway's (aiohttp), httpx, httpx over aiohttp's
transport (httpx-aiohttp, where installed) and the hand-written HTTP/1.1 client it replaced (read from git history).

    .venv/bin/python loadtests/bench_http_client.py                 # 2000 calls per cell and client, 2 rounds
    .venv/bin/python loadtests/bench_http_client.py --calls 500 --rounds 3 --old-ref b9eb938

One fake upstream (loadtests/fake_upstream.py) in its own process; every client in this process, one call at a
time, over a kept-alive connection, after a warm-up, under uvloop (as the gateway) unless --loop asyncio. Per
client: CPU-ms per call (time.process_time of this process over the calls, divided by the calls), non-stream (a
chat completion, read whole) and streamed (20 chunks, read as they come), and calls/s. Rounds interleave the
clients; the table gives medians. Not a test: compare rows within one run, on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: make `loadtests` importable

from loadtests.fake_upstream import free_port  # noqa: E402
from tokenweir.gateway.upstream.client import UpstreamClient  # noqa: E402

PATH = "/v1/chat/completions"
HEADERS = {"content-type": "application/json", "x-request-id": "bench"}


def body(stream: bool) -> bytes:
    req: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Benchmark the client."}]}
    req["fake"] = {"tokens": 20 if stream else 16}
    if stream:
        req |= {"stream": True, "stream_options": {"include_usage": True}}
    return orjson.dumps(req)


# A client: (call(url, body, stream) -> bytes received, close()).
Call = Callable[[str, bytes, bool], Awaitable[int]]
Client = tuple[Call, Callable[[], Awaitable[None]]]


def request_call(request: Callable[..., Awaitable[Any]]) -> Call:
    """A call through a client with the gateway's surface (`request(...)` -> a response with read / aiter_raw /
    aclose): ours, and the old hand-written one."""

    async def call(url: str, content: bytes, stream: bool) -> int:
        r = await request("POST", url, content, HEADERS)
        try:
            if not stream:
                return len(await r.read())
            return sum([len(part) async for part in r.aiter_raw()])
        finally:
            await r.aclose()

    return call


def gateway_client() -> Client:
    client = UpstreamClient(trust_env=False)
    return request_call(client.request), client.aclose


def old_http1_client(ref: str) -> Client | None:
    """The hand-written client as it was at `ref` (git show into a temp file, imported by path)."""
    try:
        source = subprocess.run(
            ["git", "show", f"{ref}:gateway/upstream/http1.py"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    path = Path(tempfile.mkdtemp()) / "old_http1.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("old_http1", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pool = module.HTTP1Pool(trust_env=False)
    return request_call(pool.request), pool.aclose


def httpx_client(client: httpx.AsyncClient) -> Client:
    async def call(url: str, content: bytes, stream: bool) -> int:
        request = client.build_request("POST", url, content=content, headers=HEADERS)
        r = await client.send(request, stream=True)
        try:
            if not stream:
                return len(await r.aread())
            return sum([len(part) async for part in r.aiter_raw()])
        finally:
            await r.aclose()

    return call, client.aclose


def clients(old_ref: str) -> dict[str, Client]:
    out = {"aiohttp (gateway client.py)": gateway_client()}
    old = old_http1_client(old_ref)
    if old is not None:
        out[f"http1.py ({old_ref}, removed)"] = old
    out["httpx AsyncClient"] = httpx_client(httpx.AsyncClient(trust_env=False, timeout=None))
    try:
        from httpx_aiohttp import HttpxAiohttpClient
    except ImportError:
        print("httpx-aiohttp not installed: its row is left out", file=sys.stderr)
    else:
        out["httpx + httpx-aiohttp"] = httpx_client(HttpxAiohttpClient(trust_env=False, timeout=None))
    return out


async def measure(call: Call, url: str, content: bytes, stream: bool, calls: int) -> tuple[float, float]:
    """(CPU-ms per call, calls/s) over `calls` sequential calls."""
    for _ in range(max(20, calls // 20)):  # warm-up: connection made, caches filled
        await call(url, content, stream)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        if not await call(url, content, stream):
            raise RuntimeError("empty answer")
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu * 1000 / calls, calls / wall


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError("the fake upstream exited")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the fake upstream did not start")


async def run(url: str, calls: int, stream_calls: int, rounds: int, old_ref: str) -> None:
    table = clients(old_ref)
    results: dict[str, dict[str, list[float]]] = {name: {"ns": [], "st": [], "rps": []} for name in table}
    content, stream_content = body(False), body(True)
    for r in range(rounds):
        for name, (call, _) in table.items():
            cpu_ns, rps = await measure(call, url + PATH, content, False, calls)
            cpu_st, _ = await measure(call, url + PATH, stream_content, True, stream_calls)
            results[name]["ns"].append(cpu_ns)
            results[name]["st"].append(cpu_st)
            results[name]["rps"].append(rps)
            print(f"round {r + 1} {name:32} non-stream {cpu_ns:6.3f}  stream {cpu_st:6.3f} CPU-ms/call  {rps:6.0f}/s")
    for _, close in table.values():
        await close()
    print(f"\nmedians of {rounds} round(s); {calls} non-stream and {stream_calls} streamed calls per client and round")
    print(f"{'client':32} | {'calls':>6} | {'CPU-ms/call':>11} | {'CPU-ms/stream (20 chunks)':>25} | {'calls/s':>7}")
    print("-" * 95)
    for name, res in results.items():
        ns, st, rps = (statistics.median(res[k]) for k in ("ns", "st", "rps"))
        print(f"{name:32} | {calls:6} | {ns:11.3f} | {st:25.3f} | {rps:7.0f}")
    print("CPU: this process's time.process_time() (the upstream runs in its own process); calls/s: non-stream")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="non-stream calls per client and round")
    parser.add_argument("--stream-calls", type=int, default=500, help="streamed calls per client and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--old-ref", default="b9eb938", help="commit whose gateway/upstream/http1.py to compare")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="the gateway's is uvloop")
    args = parser.parse_args()
    loop_factory = None
    if args.loop == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    port = free_port()
    cmd = [sys.executable, "-m", "loadtests.fake_upstream", "--port", str(port)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url, proc)
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(run(url, args.calls, args.stream_calls, args.rounds, args.old_ref))
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
