"""Interactive TTFT with and without a batch running beside it: does a /v1/batches job keep out of interactive
traffic's way? The gateway (in process, under uvicorn) fronts the fake upstream through a pool of `capacity` dispatch
slots, the contention; interactive clients stream chats in closed loops while, in the second run, a 300-line batch
is submitted through the `openai` SDK. Batch lines run at the batch band and start only while no interactive request
waits in a dispatch queue, so what interactive traffic loses is at most the tail of batch lines already holding slots.

    .venv/bin/python loadtests/bench_batches.py            # 3 x 20 s
    .venv/bin/python loadtests/bench_batches.py --quick    # 3 x 8 s

Prints TTFT p50 / p95 / max of the interactive requests in each run side by side, and the batch lines done: alone,
beside the batch, and beside it with `batches.interactive_headroom: 1` (batch lines leave one slot of the pool free).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: make `loadtests` and `tests` importable

import openai  # noqa: E402
import orjson  # noqa: E402

from loadtests.fake_upstream import FakeUpstream  # noqa: E402
from tests.support.serve_thread import ServerThread, serve_app  # noqa: E402
from tokenweir.gateway.config import (  # noqa: E402
    BatchesConfig,
    EventsConfig,
    GatewayConfig,
    PoolConfig,
    UpstreamConfig,
)

MODEL, CHAT = "fake-model", "/v1/chat/completions"
CAPACITY = 4  # the pool's dispatch slots
INTERACTIVE_CLIENTS = 3  # closed loops: fewer than the slots, so alone they never queue
SERVICE = {"ttft_ms": 40, "itl_ms": 2}  # what one interactive request costs at the fake upstream
BATCH_SERVICE = {"ttft_ms": 150, "itl_ms": 2}  # a batch line: longer (300 of them outlast a run)
BATCH_LINES = 300


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def interactive(client: openai.AsyncOpenAI, until: float, ttfts: list[float]) -> None:
    while time.monotonic() < until:
        started = time.perf_counter()
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "how are you"}], max_tokens=8, stream=True,
            extra_body={"fake": SERVICE},
        )  # fmt: skip
        first = True
        async for _ in stream:
            if first:
                ttfts.append((time.perf_counter() - started) * 1000)
                first = False


def batch_file() -> bytes:
    lines = [
        {"custom_id": f"b{i}", "method": "POST", "url": CHAT,
         "body": {"model": MODEL, "messages": [{"role": "user", "content": f"summarize item {i}"}], "max_tokens": 8,
                  "fake": BATCH_SERVICE}}
        for i in range(BATCH_LINES)
    ]  # fmt: skip
    return b"\n".join(orjson.dumps(line) for line in lines)


async def run(url: str, secret: str, seconds: float, with_batch: bool) -> tuple[list[float], int]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=secret, max_retries=0)
    batch_id = None
    if with_batch:
        uploaded = await client.files.create(file=("batch.jsonl", batch_file()), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        batch_id = batch.id
        await asyncio.sleep(0.5)  # the batch fills the pool first
    ttfts: list[float] = []
    until = time.monotonic() + seconds
    await asyncio.gather(*(interactive(client, until, ttfts) for _ in range(INTERACTIVE_CLIENTS)))
    done = 0
    if batch_id is not None:
        batch = await client.batches.retrieve(batch_id)
        done = batch.request_counts.completed
        if batch.status in ("validating", "in_progress"):
            await client.batches.cancel(batch_id)
    return ttfts, done


def measure(headroom: int, seconds: float, with_batch: bool) -> tuple[list[float], int]:
    """One run on a fresh gateway whose batch lines leave `headroom` slots of the pool free."""
    from tokenweir.gateway.store.store import Store

    with tempfile.TemporaryDirectory() as tmp, ServerThread(FakeUpstream(model=MODEL)) as upstream:
        store = Store.open(f"sqlite:///{tmp}/store.db")
        team = store.create_team("bench")
        secret, _ = store.create_key(team.id, "bench")
        config = GatewayConfig(
            port=0,
            pools=[PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream.url)], capacity=CAPACITY)],
            events=EventsConfig(path=f"{tmp}/events.jsonl"),
            batches=BatchesConfig(concurrency=CAPACITY, poll_interval_s=0.2, interactive_headroom=headroom),
            log_level="warning",
        )
        try:
            with serve_app(config, store=store) as gateway:
                return asyncio.run(run(gateway.url, secret, seconds, with_batch))
        finally:
            store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    seconds = 8.0 if args.quick else 20.0
    runs = {
        "alone": measure(0, seconds, with_batch=False),
        f"beside {BATCH_LINES}-line batch": measure(0, seconds, with_batch=True),
        "  + headroom 1 slot": measure(1, seconds, with_batch=True),
    }
    clients = f"{INTERACTIVE_CLIENTS} streaming clients, pool capacity {CAPACITY}"
    print(f"interactive TTFT (ms): {clients}, {seconds:g} s a run")
    print(f"{'':28}{'requests':>9}{'p50':>8}{'p95':>8}{'max':>8}{'batch lines done':>18}")
    for name, (ttfts, done) in runs.items():
        p50, p95 = statistics.median(ttfts), percentile(ttfts, 0.95)
        print(f"{name:28}{len(ttfts):>9}{p50:>8.1f}{p95:>8.1f}{max(ttfts):>8.1f}{done:>18}")


if __name__ == "__main__":
    main()
