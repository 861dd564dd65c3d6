"""A 300-line batch beside interactive traffic on `tokenweir serve` (the bundled engine on the default model): the
interactive clients' TTFT alone and beside the batch, side by side, then the batch to its end, its output checked
(every line answered once) and billed (the output's usage == the lines' events == what the engine served).

    .venv/bin/python loadtests/bench_batches_engine.py [--seconds 60] [--lines 300] [--plot FILE.png]

Interactive clients stream short chats in closed loops at the default band; the batch's lines run at the batch band,
and the engine schedules (and preempts) by that band, so an interactive request waits for no batch line. The batch's
lines are paced by the gateway too (`batches.concurrency`, and no line starts while an interactive request waits
in a dispatch queue). The table is what this run printed; the note gives the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from loadtests.bench_batches import percentile  # noqa: E402
from loadtests.bench_routing import MODEL, Serve  # noqa: E402

CHAT = "/v1/chat/completions"
INTERACTIVE_CLIENTS = 2
TOPICS = ["tides", "bread", "comets", "tea", "bridges", "owls", "glass", "maps", "violins", "salt"]


async def interactive(client: openai.AsyncOpenAI, until: float, ttfts: list[float], n: int) -> None:
    i = 0
    while time.monotonic() < until:
        i += 1
        started = time.perf_counter()
        question = f"In one sentence, what is {TOPICS[(n + i) % len(TOPICS)]}?"
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=16, stream=True, temperature=0
        )
        first = True
        async for chunk in stream:
            if first and chunk.choices and chunk.choices[0].delta.content:
                ttfts.append((time.perf_counter() - started) * 1000)
                first = False


def batch_file(lines: int) -> bytes:
    rows = [
        {"custom_id": f"doc-{i}", "method": "POST", "url": CHAT,
         "body": {"model": MODEL, "max_tokens": 16, "temperature": 0,
                  "messages": [{"role": "user", "content": f"Summarize document {i} about {TOPICS[i % 10]}."}]}}
        for i in range(lines)
    ]  # fmt: skip
    return "\n".join(json.dumps(r) for r in rows).encode()


async def phase(client: openai.AsyncOpenAI, seconds: float) -> list[float]:
    ttfts: list[float] = []
    until = time.monotonic() + seconds
    await asyncio.gather(*(interactive(client, until, ttfts, n) for n in range(INTERACTIVE_CLIENTS)))
    return ttfts


async def bench(url: str, key: str, seconds: float, lines: int, events: Path) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)
    print("interactive alone ...", flush=True)
    alone = await phase(client, seconds)
    uploaded = await client.files.create(file=("docs.jsonl", batch_file(lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    print(f"interactive beside {batch.id} ({lines} lines) ...", flush=True)
    beside = await phase(client, seconds)
    t0 = time.monotonic()
    while (batch := await client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        counts = batch.request_counts
        print(
            f"  batch {batch.status}: {counts.completed}/{counts.total} done ({time.monotonic() - t0:.0f} s)",
            flush=True,
        )
        await asyncio.sleep(10)
    output = (await client.files.content(batch.output_file_id)).text.splitlines() if batch.output_file_id else []
    answers = [json.loads(line) for line in output]
    ids = [a["custom_id"] for a in answers]
    billed = sum(a["response"]["body"]["usage"]["total_tokens"] for a in answers)
    time.sleep(1.0)  # the last events' lines
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    lines_events = [r for r in rows if r.get("batch_id") == batch.id]
    served = sum((r.get("prompt_tokens") or 0) + (r.get("completion_tokens") or 0) for r in lines_events)
    return {
        "alone": alone,
        "beside": beside,
        "status": batch.status,
        "answered": len(answers),
        "unique": len(set(ids)),
        "failed": batch.request_counts.failed,
        "billed": billed,
        "events": len(lines_events),
        "served": served,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each interactive phase")
    parser.add_argument("--lines", type=int, default=300)
    parser.add_argument("--plot", help="write the two TTFT distributions as a PNG here")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-batches-"))
    events = tmp / "events.jsonl"
    config = tmp / "tokenweir.yaml"
    config.write_text(json.dumps({"events": {"path": str(events)}}))  # JSON is YAML
    serve = Serve(config, engines=1, store=tmp / "tw.db")
    print("starting tokenweir serve ...", flush=True)
    try:
        serve.wait_ready()
        key = serve.team_keys({"docs": {}})["docs"]
        r = asyncio.run(bench(serve.url, key, args.seconds, args.lines, events))
    finally:
        serve.stop()
    print(f"\ninteractive TTFT (ms), {INTERACTIVE_CLIENTS} streaming clients, {args.seconds:g} s a phase")
    print("| phase | requests | p50 | p95 | max |\n|---|---|---|---|---|")
    for name in ("alone", "beside"):
        t = r[name]
        print(f"| {name} | {len(t)} | {statistics.median(t):.0f} | {percentile(t, 0.95):.0f} | {max(t):.0f} |")
    print(f"p95 beside / alone: {percentile(r['beside'], 0.95) / percentile(r['alone'], 0.95):.2f}x")
    print(
        f"\nbatch {r['status']}: {r['answered']} answered ({r['unique']} distinct custom_ids), {r['failed']} failed; "
        f"tokens in the output's usage {r['billed']}, in the lines' {r['events']} events {r['served']}"
    )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.boxplot([r["alone"], r["beside"]], tick_labels=["alone", f"beside a {args.lines}-line batch"])
        ax.set_ylabel("interactive TTFT (ms)")
        ax.set_title("tokenweir serve: interactive TTFT beside a batch")
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()
