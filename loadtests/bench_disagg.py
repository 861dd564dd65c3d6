"""Disaggregated prefill against colocated engines, on one machine with the same threads in total:

    .venv/bin/python loadtests/bench_disagg.py --plot loadtests/results/bench_disagg.png
    .venv/bin/python loadtests/bench_disagg.py --seconds 30 --workloads mixed      # shorter, one workload

- colocated: two engines of `--threads-per-engine` threads each, every request to the one with the fewest requests
  in flight (prompts here never repeat, so a prefix-aware router would route by load too);
- disaggregated: a prefill engine (`--kv-transfer-config '{"kv_role": "kv_producer"}'`) and a decode engine
  (`kv_consumer`), same threads each: every request goes first to the prefill engine with max_tokens 1 and
  `kv_transfer_params: {"do_remote_decode": true}`, then, with the answer's kv_transfer_params, streamed from the
  decode engine, which fetches the prompt's KV over TCP (the gateway's two-hop route, done here by the client).

Workloads, arrivals at a steady rate over `--seconds`: "mixed", long documents (2-3k-token prompts, 8 tokens out)
among short chats (100-160 tokens out), the workload disaggregation is for; "chats only", the one it is not for. Per
class: TTFT p50/p99, TPOT p50/p99 (per request: (last chunk - first chunk) / (tokens - 1)), ITL p99 (the chunk
gaps, where a decode stalled behind a prefill shows), output tok/s over the run, and the KV transfer per request
(bytes and fetch ms, from the decode engine's /metrics). One configuration at a time; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from loadtests import llama_server  # noqa: E402
from loadtests.bench_levers import WORDS, Request, Result, chat, engine_counters, send  # noqa: E402
from tokenweir.common.text.model_files import default_model_path  # noqa: E402

PRODUCER = json.dumps({"kv_role": "kv_producer"})
ENGINE_ENV = {**os.environ, "TOKENWEIR_KV_TRANSFER_KEY": os.urandom(32).hex()}  # one key: the consumer trusts it
CONSUMER = json.dumps({"kv_role": "kv_consumer"})
CONFIGS = ("colocated", "disaggregated")
# Steps of 512 tokens, of which one prompt takes at most 256: a chat's prompt arriving behind a document's starts at
# once (on the prefill engine too), instead of waiting until the document is done; `--threshold 0` lets a document
# take whole steps.
THRESHOLD = 256
MAX_MODEL_LEN = 4096


@dataclass
class Engine:
    proc: subprocess.Popen
    url: str
    in_flight: int = 0


def start_engine(path: str, threads: int, flags: list[str], max_model_len: int, threshold: int) -> Engine:
    port = llama_server.free_port()
    cmd = [sys.executable, "-m", "tokenweir.engine.server", "--model", path, "--served-model-name", "default",
           "--port", str(port), "--num-threads", str(threads), "--log-level", "warning",
           "--max-model-len", str(max_model_len), "--max-num-batched-tokens", "512",
           "--long-prefill-token-threshold", str(threshold), *flags]  # fmt: skip
    with open(f"/tmp/tokenweir-bench-disagg-{port}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENGINE_ENV)
    engine = Engine(proc, f"http://127.0.0.1:{port}")
    llama_server.wait_healthy(proc, engine.url, 600)
    return engine


def workloads(rng: random.Random, seconds: float) -> dict[str, list[Request]]:
    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    chats = [
        Request(
            chat(f"Chat {i}: tell me a story about a {rng.choice(WORDS)} and a {rng.choice(WORDS)}."),
            rng.randint(100, 160),
            at=1.2 * i,
        )  # fmt: skip
        for i in range(int(seconds / 1.2))
    ]
    documents = [
        Request(
            chat(f"Document {i}. Summarize it in one line:\n" + words(rng.randint(1900, 2800))),
            8,
            at=3.0 + 7.0 * i,
            kind="doc",
        )  # fmt: skip
        for i in range(int((seconds - 3.0) / 7.0))
    ]
    return {"mixed": sorted(chats + documents, key=lambda r: r.at), "chats only": chats}


async def run(config: str, engines: list[Engine], requests: list[Request]) -> tuple[list[Result], float]:
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(request: Request) -> Result:
            await asyncio.sleep(max(0.0, t0 + request.at - time.perf_counter()))
            if config == "colocated":
                engine = min(engines, key=lambda e: e.in_flight)
                engine.in_flight += 1
                try:
                    return await send(client, engine.url, request)
                finally:
                    engine.in_flight -= 1
            prefill, decode = engines
            start = time.perf_counter()
            body = {"model": "default", "messages": request.messages, "max_tokens": 1, "temperature": 0}
            r = await client.post(
                prefill.url + "/v1/chat/completions", json={**body, "kv_transfer_params": {"do_remote_decode": True}}
            )
            r.raise_for_status()
            answer = r.json()["kv_transfer_params"]
            return await send(client, decode.url, request, {"kv_transfer_params": answer}, start)

        results = await asyncio.gather(*(one(r) for r in requests))
    return list(results), time.perf_counter() - t0


TRANSFER_COUNTERS = {
    "fetches": "tokenweir:kv_transfer_fetches_total",
    "failures": "tokenweir:kv_transfer_fetch_failures_total",
    "bytes": "tokenweir:kv_transfer_received_bytes_total",
    "seconds": "tokenweir:kv_transfer_fetch_seconds_total",
}


def pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def indicators(results: list[Result], wall: float, kind: str) -> dict:
    picked = [r for r in results if r.kind == kind]
    ttfts = [r.ttft * 1000 for r in picked]
    tpots = [r.tpot * 1000 for r in picked if r.tpot is not None]
    return {
        "n": len(picked),
        "ttft_p50": statistics.median(ttfts) if ttfts else None,
        "ttft_p95": pct(ttfts, 0.95),
        "ttft_p99": pct(ttfts, 0.99),
        "tpot_p50": statistics.median(tpots) if tpots else None,
        "tpot_p95": pct(tpots, 0.95),
        "tpot_p99": pct(tpots, 0.99),
        "itl_p99": pct([g * 1000 for r in picked for g in r.gaps], 0.99),
        "tok_s": sum(r.tokens for r in results) / wall,
    }


def measure(config: str, path: str, threads: int, load: dict[str, list[Request]], threshold: int) -> dict:
    roles = [[], []] if config == "colocated" else [["--kv-transfer-config", r] for r in (PRODUCER, CONSUMER)]
    engines = [start_engine(path, threads, flags, MAX_MODEL_LEN, threshold) for flags in roles]
    out: dict = {}
    try:
        asyncio.run(run(config, engines, [Request(chat("Hello"), 4)]))  # warm-up
        for name, requests in load.items():
            before = engine_counters(engines[1].url, TRANSFER_COUNTERS)
            results, wall = asyncio.run(run(config, engines, requests))
            after = engine_counters(engines[1].url, TRANSFER_COUNTERS)
            delta = {k: after[k] - before[k] for k in after}
            for kind in dict.fromkeys(r.kind for r in requests):
                row = indicators(results, wall, kind)
                if delta["fetches"]:
                    row["kv_mib"] = delta["bytes"] / delta["fetches"] / 2**20
                    row["kv_ms"] = 1000 * delta["seconds"] / delta["fetches"]
                    row["kv_failed"] = delta["failures"]
                out[(name, kind)] = row
            print(f"  [{config}] {name}: {len(results)} requests in {wall:.1f} s", flush=True)
    finally:
        for engine in engines:
            engine.proc.terminate()
        for engine in engines:
            engine.proc.wait(30)
    return out


COLUMNS = [
    ("n", "requests"),
    ("ttft_p50", "TTFT p50 ms"),
    ("ttft_p99", "TTFT p99 ms"),
    ("tpot_p50", "TPOT p50 ms"),
    ("tpot_p99", "TPOT p99 ms"),
    ("itl_p99", "ITL p99 ms"),
    ("tok_s", "output tok/s"),
    ("kv_mib", "KV MiB/req"),
    ("kv_ms", "fetch ms/req"),
]


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def print_table(results: dict[str, dict]) -> None:
    print("\n| workload | class | config | " + " | ".join(label for _, label in COLUMNS) + " |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    for key in results["colocated"]:
        base, disagg = results["colocated"][key], results["disaggregated"][key]
        for config, row in (("colocated", base), ("disaggregated", disagg)):
            print(f"| {key[0]} | {key[1]} | {config} | " + " | ".join(fmt(row.get(k)) for k, _ in COLUMNS) + " |")
        ratios = [
            f"{disagg[k] / base[k]:.2f}x" if base.get(k) and disagg.get(k) is not None and k != "n" else "-"
            for k, _ in COLUMNS
        ]
        print(f"| {key[0]} | {key[1]} | disagg/coloc | " + " | ".join(ratios) + " |")


def plot(results: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in results["colocated"] if k[1] == "chat"]
    panels = [("tpot_p99", "chats' TPOT p99 ms"), ("ttft_p50", "chats' TTFT p50 ms"), ("tok_s", "output tok/s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4))
    for ax, (metric, label) in zip(axes, panels, strict=True):
        for i, config in enumerate(CONFIGS):
            values = [results[config][k][metric] or 0 for k in keys]
            bars = ax.bar([x + 0.38 * i for x in range(len(keys))], values, 0.38, label=config)
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks([x + 0.19 for x in range(len(keys))], [k[0] for k in keys], fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(
        "disaggregated prefill (1 prefill + 1 decode engine) vs 2 colocated engines, same threads", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--threads-per-engine", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--seconds", type=float, default=60.0, help="arrivals over this long")
    ap.add_argument("--workloads", nargs="*", default=["mixed", "chats only"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threshold", type=int, default=THRESHOLD, help="--long-prefill-token-threshold of every engine")
    ap.add_argument("--plot", default="")
    args = ap.parse_args()
    path = args.model or default_model_path()
    load = {k: v for k, v in workloads(random.Random(args.seed), args.seconds).items() if k in args.workloads}
    results = {}
    for config in CONFIGS:
        results[config] = measure(config, path, args.threads_per_engine, load, args.threshold)
    print(
        f"\n{args.threads_per_engine} thread(s) per engine, 2 engines, steps of 512 tokens, a prompt's chunk at most "
        f"{args.threshold or 512}, greedy, seed {args.seed}, arrivals over {args.seconds:g} s"
    )
    print_table(results)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
