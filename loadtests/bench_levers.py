"""The lever lab: each serving lever off, then on, on the workload it is for and on one it is not for, against the
same engine build, one server at a time, same prompts, same order, greedy:

    .venv/bin/python loadtests/bench_levers.py --plot loadtests/results/bench_levers.png
    .venv/bin/python loadtests/bench_levers.py --levers speculative structured     # some levers only

Lever (off / on, server flags): workload it is for; workload it is not for.
- prefix caching (--no-enable-prefix-caching / default): 24 requests sharing a long system prompt; unique prompts.
- chunked prefill (--no-enable-chunked-prefill, a prompt in one step / chunks of 256): long documents arriving among
  short chats (indicators over the chats); the chats alone.
- scheduling (--scheduling-policy fcfs / shortest-prompt): 16 prompts at once of mixed lengths (TTFT p50 is the
  indicator; p95, the longest prompts', pays for it); 16 prompts of one length.
- speculative (off / ngram k=4): copying answers (code edits, extraction, quoting), one at a time; open chat.
- structured outputs (no response_format / json_schema): extraction prompts asking for JSON; open chat as json_object.
- disaggregated prefill (2 colocated engines / 1 prefill + 1 decode engine, the threads split evenly between the two
  engines either way; loadtests/bench_disagg.py's runs, over --disagg-seconds of arrivals): long documents among short
  chats (indicators over the chats); the chats alone.

Indicators per run (client side, streamed): TTFT p50/p95, TPOT p50/p95 (per request: (last chunk - first chunk) /
(completion tokens - 1)), ITL p99 (the gaps between a stream's chunks: a decode stalled behind a prefill shows here,
where a per-request TPOT averages it away), output tok/s over the run, the engine's mean queue time, prefix-cache hit
ratio and draft acceptance (from its /metrics, before and after), and the invalid-JSON rate (extraction: the answer
must parse and validate against the schema). The table prints off, on, and on/off for each; the plot shows each
lever's headline indicator. Every row is one run: on a shared machine, compare rows of the same invocation only.
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
import urllib.request
from dataclasses import dataclass, field

import httpx
import jsonschema
import orjson

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from loadtests import llama_server  # noqa: E402
from loadtests.bench_spec import WORKLOADS as SPEC_WORKLOADS  # noqa: E402
from tokenweir.common.text.model_files import default_model_path  # noqa: E402

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string"},
        "city": {"type": "string"},
        "age": {"type": "integer"},
    },
    "required": ["name", "email", "city", "age"],
}
WORDS = [
    *("river", "stone", "garden", "window", "market", "engine", "silver", "paper", "forest", "winter", "signal"),
    *("harbor", "orange", "castle", "pencil", "thunder", "meadow", "copper", "lantern", "violin", "desert"),
    *("pocket", "marble", "rocket", "candle", "mirror", "valley", "feather", "anchor"),
]


@dataclass
class Request:
    messages: list[dict]
    max_tokens: int
    at: float = 0.0  # seconds after the workload starts
    kind: str = "chat"  # the class the indicators are computed over where a workload says so
    response_format: dict | None = None
    schema: dict | None = None  # the answer must be JSON valid under it (the invalid-JSON rate)


@dataclass
class Workload:
    name: str
    requests: list[Request]
    concurrency: int = 4  # requests in flight at most (arrival times permitting)
    measure: str | None = None  # the kind the indicators are over (None: every request)


@dataclass
class Result:
    kind: str
    ttft: float
    tpot: float | None
    tokens: int
    valid: bool | None
    gaps: list[float]  # seconds between successive chunks carrying text (inter-token latency; a stall shows here)


@dataclass
class Lever:
    name: str
    off: list[str]
    on: list[str]
    workloads: list[Workload]
    headline: tuple[str, str]  # (indicator key, its label) for the plot
    results: dict = field(default_factory=dict)  # (workload, "off"|"on") -> indicators


def chat(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prefix_workloads(rng: random.Random) -> list[Workload]:
    system = "You are the support assistant of Weir Logistics. Policies:\n" + "\n".join(
        f"- Rule {i}: {words(rng, 24)}." for i in range(24)
    )
    questions = [f"Question {i}: what does rule {i % 24} say about {rng.choice(WORDS)}?" for i in range(24)]
    shared = [Request(chat(q, system), 16) for q in questions]
    unique = [Request(chat(q, "You are an assistant. Notes:\n" + words(rng, 24 * 26)), 16) for q in questions]
    return [Workload("shared system prompt", shared), Workload("unique prompts", unique)]


def chunked_workloads(rng: random.Random) -> list[Workload]:
    chats = [Request(chat(f"Tell me about the {rng.choice(WORDS)}."), 64, at=0.4 * i) for i in range(12)]
    documents = [
        Request(chat("Summarize this document in one line:\n" + words(rng, 1400)), 8, at=0.5 + 1.2 * i, kind="doc")
        for i in range(4)
    ]
    mixed = sorted(chats + documents, key=lambda r: r.at)
    alone = [Request(r.messages, r.max_tokens, at=r.at) for r in chats]
    return [Workload("long docs + chats", mixed, 16, measure="chat"), Workload("chats only", alone, 16)]


def scheduling_workloads(rng: random.Random) -> list[Workload]:
    """16 prompts at once, of mixed lengths (~30 to ~1000 tokens) or all of one length (the order cannot matter)."""
    mixed = [Request(chat("Summarize in one line:\n" + words(rng, rng.randint(20, 750))), 16) for _ in range(16)]
    same = [Request(chat("Summarize in one line:\n" + words(rng, 385)), 16) for _ in range(16)]
    return [Workload("burst, mixed lengths", mixed, 16), Workload("burst, one length", same, 16)]


def speculative_workloads() -> list[Workload]:
    copying = [Request(chat(p), 128) for p in SPEC_WORKLOADS["copying"]]
    open_chat = [Request(chat(p), 128) for p in SPEC_WORKLOADS["open"]]
    return [Workload("copying", copying, 1), Workload("open chat", open_chat, 1)]


def structured_workloads(rng: random.Random, on: bool) -> list[Workload]:
    people = [("Maria Lopez", "Madrid"), ("Tom Berg", "Oslo"), ("Aiko Sato", "Kyoto"), ("Liam Walsh", "Cork")]
    extraction = []
    for i in range(8):
        name, city = people[i % 4]
        email = name.lower().replace(" ", ".") + "@example.com"
        text = (
            f"Customer note: {name} ({email}) wrote from {city}; they are {25 + 3 * i} years old and asked about "
            f"their order. Extract the customer's name, email, city and age as a JSON object with the keys name, "
            f"email, city, age. Answer with the JSON only."
        )
        schema_format = {"type": "json_schema", "json_schema": {"name": "customer", "schema": RECORD_SCHEMA}}
        extraction.append(Request(chat(text), 96, response_format=schema_format if on else None, schema=RECORD_SCHEMA))
    open_chat = [
        Request(chat(p + " Answer as a JSON object."), 64, response_format={"type": "json_object"} if on else None)
        for p in SPEC_WORKLOADS["open"]
    ]
    return [Workload("extraction", extraction), Workload("open chat as JSON", open_chat)]


async def send(
    client: httpx.AsyncClient, url: str, request: Request, extra: dict | None = None, start: float | None = None
) -> Result:
    """Stream one request; `extra` joins the body, `start` (perf_counter) is when its TTFT began (a hop earlier)."""
    body: dict = {
        "model": "default",
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.response_format is not None:
        body["response_format"] = request.response_format
    body |= extra or {}
    start = time.perf_counter() if start is None else start
    first = last = None
    tokens = 0
    text: list[str] = []
    gaps: list[float] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and (piece := chunk["choices"][0].get("delta", {}).get("content")):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                first = first or last
                text.append(piece)
    first = first or time.perf_counter()
    tpot = (last - first) / (tokens - 1) if last is not None and tokens > 1 else None
    valid = None
    if request.schema is not None:
        try:
            jsonschema.validate(json.loads("".join(text)), request.schema)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
    return Result(request.kind, first - start, tpot, tokens, valid, gaps)


async def run_workload(url: str, workload: Workload) -> tuple[list[Result], float]:
    gate = asyncio.Semaphore(workload.concurrency)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(request: Request) -> Result:
            await asyncio.sleep(max(0.0, t0 + request.at - time.perf_counter()))
            async with gate:
                return await send(client, url, request)

        results = await asyncio.gather(*(one(r) for r in workload.requests))
    return list(results), time.perf_counter() - t0


LEVER_COUNTERS = {
    "queue_sum": "tokenweir:request_queue_time_seconds_sum",
    "queue_count": "tokenweir:request_queue_time_seconds_count",
    "hits": "tokenweir:prefix_cache_hits_total",
    "queries": "tokenweir:prefix_cache_queries_total",
    "drafted": "tokenweir:spec_decode_num_draft_tokens_total",
    "accepted": "tokenweir:spec_decode_num_accepted_tokens_total",
}


def engine_counters(url: str, names: dict[str, str] = LEVER_COUNTERS) -> dict[str, float]:
    """The engine's /metrics values of `names` (key -> series name), each summed over its labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    values = dict.fromkeys(names, 0.0)
    for line in lines:
        for key, name in names.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                values[key] += float(line.rsplit(" ", 1)[1])
    return values


def indicators(results: list[Result], wall: float, before: dict, after: dict, measure: str | None) -> dict:
    picked = [r for r in results if measure is None or r.kind == measure]
    ttfts = sorted(r.ttft * 1000 for r in picked)
    tpots = sorted(r.tpot * 1000 for r in picked if r.tpot is not None)
    itls = sorted(g * 1000 for r in picked for g in r.gaps)
    delta = {k: after[k] - before[k] for k in after}
    checked = [r.valid for r in picked if r.valid is not None]

    def pct(values: list[float], q: float) -> float | None:
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    return {
        "ttft_p50": statistics.median(ttfts) if ttfts else None,
        "ttft_p95": pct(ttfts, 0.95),
        "tpot_p50": statistics.median(tpots) if tpots else None,
        "tpot_p95": pct(tpots, 0.95),
        "itl_p99": pct(itls, 0.99),
        "tok_s": sum(r.tokens for r in results) / wall,
        "queue_ms": 1000 * delta["queue_sum"] / delta["queue_count"] if delta["queue_count"] else None,
        "hit": delta["hits"] / delta["queries"] if delta["queries"] else None,
        "accept": delta["accepted"] / delta["drafted"] if delta["drafted"] else None,
        "invalid": 1 - sum(checked) / len(checked) if checked else None,
    }


def run_server(path: str, threads: int, flags: list[str], workloads: list[Workload], label: str) -> dict:
    port = llama_server.free_port()
    cmd = [sys.executable, "-m", "tokenweir.engine.server", "--model", path, "--served-model-name", "default",
           "--port", str(port), "--num-threads", str(threads), "--log-level", "warning", *flags]  # fmt: skip
    log_path = f"/tmp/tokenweir-bench-levers-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        llama_server.wait_healthy(proc, url, 600)
        asyncio.run(run_workload(url, Workload("warm-up", [Request(chat("Hello"), 4)])))
        out = {}
        for workload in workloads:
            before = engine_counters(url)
            results, wall = asyncio.run(run_workload(url, workload))
            out[workload.name] = indicators(results, wall, before, engine_counters(url), workload.measure)
            print(f"  [{label}] {workload.name}: {len(results)} requests in {wall:.1f} s", flush=True)
        return out
    finally:
        proc.terminate()
        proc.wait(30)


def levers(seed: int) -> list[Lever]:
    rng = random.Random(seed)
    return [
        Lever("prefix caching", ["--no-enable-prefix-caching"], [], prefix_workloads(rng), ("ttft_p50", "TTFT p50 ms")),
        Lever(
            "chunked prefill",
            ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096", "--max-model-len", "4096"],
            ["--max-num-batched-tokens", "256", "--max-model-len", "4096"],
            chunked_workloads(rng),
            ("itl_p99", "chats' ITL p99 ms"),
        ),
        Lever(
            "scheduling (shortest prompt)",
            [],
            ["--scheduling-policy", "shortest-prompt"],
            scheduling_workloads(rng),
            ("ttft_p50", "TTFT p50 ms"),
        ),
        Lever("speculative", [], ["--speculative-config", SPEC], speculative_workloads(), ("tpot_p50", "TPOT p50 ms")),
        Lever("structured", [], [], [], ("invalid", "invalid JSON rate")),
        Lever("disaggregated prefill", [], [], [], ("tpot_p95", "chats' TPOT p95 ms")),
    ]


def disaggregated_rows(path: str, threads: int, seed: int, seconds: float) -> dict:
    """The disaggregated-prefill lever, off (two colocated engines) and on (a prefill and a decode engine), through
    loadtests/bench_disagg.py: the short chats' indicators (the class it is for), per workload and setting."""
    from loadtests import bench_disagg  # imports this module's request helpers: imported once this one is loaded

    load = bench_disagg.workloads(random.Random(seed), seconds)
    rows = {}
    for setting, config in (("off", "colocated"), ("on", "disaggregated")):
        measured = bench_disagg.measure(config, path, max(1, threads // 2), load, bench_disagg.THRESHOLD)
        for (workload, kind), row in measured.items():
            if kind == "chat":
                rows[(workload, setting)] = {key: row.get(key) for key, _ in COLUMNS}
    return rows


def fmt(value: float | None, key: str) -> str:
    if value is None:
        return "-"
    if key in ("hit", "accept", "invalid"):
        return f"{value:.0%}"
    return f"{value:.1f}" if key == "tok_s" or value < 100 else f"{value:.0f}"


COLUMNS = [
    ("ttft_p50", "TTFT p50"),
    ("ttft_p95", "TTFT p95"),
    ("tpot_p50", "TPOT p50"),
    ("tpot_p95", "TPOT p95"),
    ("itl_p99", "ITL p99"),
    ("tok_s", "tok/s"),
    ("queue_ms", "queue ms"),
    ("hit", "cache hit"),
    ("accept", "accept"),
    ("invalid", "invalid JSON"),
]


def print_table(done: list[Lever]) -> None:
    print("\n| lever | workload | setting | " + " | ".join(label for _, label in COLUMNS) + " |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    for lever in done:
        for workload in dict.fromkeys(w for w, _ in lever.results):
            off, on = lever.results[(workload, "off")], lever.results[(workload, "on")]
            for setting, row in (("off", off), ("on", on)):
                cells = " | ".join(fmt(row[k], k) for k, _ in COLUMNS)
                print(f"| {lever.name} | {workload} | {setting} | {cells} |")
            ratios = []
            for key, _ in COLUMNS:
                a, b = off[key], on[key]
                if a is None or b is None:
                    ratios.append("-")
                elif key in ("hit", "accept", "invalid"):
                    ratios.append(f"{(b - a) * 100:+.0f} pts")
                else:
                    ratios.append(f"{b / a:.2f}x" if a else "-")
            print(f"| {lever.name} | {workload} | on/off | " + " | ".join(ratios) + " |")


def plot(done: list[Lever], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(done), figsize=(max(4.2 * len(done), 8.0), 4), squeeze=False)
    for ax, lever in zip(axes[0], done, strict=True):
        key, label = lever.headline
        workloads = list(dict.fromkeys(w for w, _ in lever.results))
        for i, setting in enumerate(("off", "on")):
            values = [lever.results[(w, setting)][key] or 0 for w in workloads]
            bars = ax.bar([x + 0.38 * i for x in range(len(workloads))], values, 0.38, label=setting)
            ax.bar_label(bars, fmt="%.2f" if key == "invalid" else "%.0f", fontsize=8)
        ax.set_xticks([x + 0.19 for x in range(len(workloads))], workloads, fontsize=8)
        ax.set_title(f"{lever.name}: {label}", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle("lever lab: off vs on, the workload it is for (left) and one it is not for (right)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    names = ["prefix", "chunked", "scheduling", "speculative", "structured", "disaggregated"]
    ap.add_argument("--levers", nargs="*", default=names)
    ap.add_argument("--disagg-seconds", type=float, default=40.0, help="disaggregated prefill: arrivals over this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="")
    args = ap.parse_args()
    path = args.model or default_model_path()
    done = []
    for lever in levers(args.seed):
        if not any(lever.name.startswith(name) for name in args.levers):
            continue
        if lever.name == "disaggregated prefill":
            lever.results = disaggregated_rows(path, args.threads, args.seed, args.disagg_seconds)
            done.append(lever)
            continue
        for setting in ("off", "on"):
            if lever.name == "structured":  # the lever is per request: one server, the requests differ
                workloads = structured_workloads(random.Random(args.seed), setting == "on")
            else:
                workloads = lever.workloads
            flags = lever.off if setting == "off" else lever.on
            rows = run_server(path, args.threads, flags, workloads, f"{lever.name} {setting}")
            for name, row in rows.items():
                lever.results[(name, setting)] = row
        done.append(lever)
    print(f"\nthreads {args.threads}, greedy, seed {args.seed}")
    print_table(done)
    if args.plot:
        plot(done, args.plot)


if __name__ == "__main__":
    main()
