"""The speculative-decoding lever at batch 1, ours and llama-server's, each off and on, one request at a time:

    .venv/bin/python loadtests/bench_spec.py --plot loadtests/results/bench_spec.png
    .venv/bin/python loadtests/bench_spec.py --skip-llama --max-tokens 96     # ours only, shorter

Two workloads of chat requests (greedy): `copying`, what prompt lookup is for (code edits, JSON extraction,
quoting, fixing a text: the answer repeats the prompt), and `open`, what it is not for (stories and explanations).
Per request: decode tok/s = (completion tokens - 1) / (last chunk - first chunk) of its stream; per row and workload
the median over the requests, and the drafts' acceptance (ours from /metrics, llama-server's from its final
`timings`). Every row's server is up for the whole run and they answer each prompt in turn, so a drift of the
machine's speed falls on every row alike. Rows: our engine (`auto`) without and with `--speculative-config` ngram
(one row per -k), llama-server without and with `--spec-type ngram-simple` (built once, see
loadtests/llama_server.py), the same GGUF, the same threads; and ours checking every draft (`"cost_aware": false`),
the lever without the draft budget that keeps only the drafts that pay for their rows on this device
(engine/spec_decode/draft_budget.py).
The table gives each row's speed and its ratio to our plain decoding on the same workload; the targets: copying
>= 1.5x and >= llama-server's speculative speed, open >= 1.0x (the switch keeps a lever that does not pay off).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import httpx
import orjson

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from loadtests import llama_server  # noqa: E402
from tokenweir.common.text.model_files import default_model_path  # noqa: E402


def ours_spec(k: int, cost_aware: bool = True) -> str:
    """Prompt lookup with up to k drafts; cost_aware=False: the raw lever, without the draft budget."""
    config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return orjson.dumps(config if cost_aware else {**config, "cost_aware": False}).decode()


# prompt lookup as ours: the draft follows the last occurrence of the last 4 tokens (its defaults, 12 and 48, are for
# long verbatim repeats and matched nothing in these short answers)
LLAMA_SPEC = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4", "--spec-ngram-simple-size-m", "16"]

CODE = """def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order["status"] == "paid":
            total += order["amount"]
            count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}
"""
RECORD = (
    "Customer record: name Maria Lopez; email maria.lopez@example.com; phone +34 612 345 678; street Calle Mayor 12; "
    "city Madrid; postcode 28013; country Spain; member since 2019; plan premium; last order 2026-10-02."
)
PARAGRAPH = (
    "The river rose slowly through the night, and by morning the lower fields were under water. The farmers moved "
    "their animals to the hill behind the church, where the ground stayed dry, and waited for the rain to stop."
)
WORKLOADS = {
    "copying": [
        f"Rename the variable `total` to `paid_total` in this function and return the whole function:\n\n{CODE}",
        f"Add a docstring to this function and return the whole function:\n\n{CODE}",
        f"Extract name, email, phone, city and country from this record as a JSON object:\n\n{RECORD}",
        f"Quote this paragraph exactly, then summarize it in one sentence:\n\n{PARAGRAPH}",
        "Fix the spelling and return the full text: Teh river rose slowley through the nigth, and by mornign the "
        "lower feilds were under watter.",
        f"Convert this record to YAML with one field per line:\n\n{RECORD}",
    ],
    "open": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how rainbows form.",
        "Give me three ideas for a birthday party for a ten-year-old.",
        "What are the benefits of regular exercise?",
        "Describe a walk through a forest in autumn.",
        "Why do cats purr?",
    ],
}


def stream_chat(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = None
    usage: dict = {}
    timings: dict = {}
    with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
    tokens = usage.get("completion_tokens", 0)
    assert first is not None and last is not None and tokens > 1, "the stream carried no text"
    return {"tok_s": (tokens - 1) / max(last - first, 1e-9), "tokens": tokens, "timings": timings}


def spec_counters(url: str) -> tuple[float, float]:
    """Our engine's (draft tokens, accepted tokens) so far."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {"draft": 0.0, "accepted": 0.0}
    for line in text.splitlines():
        for key, name in (
            ("draft", "spec_decode_num_draft_tokens_total"),
            ("accepted", "spec_decode_num_accepted_tokens_total"),
        ):
            if line.startswith(f"tokenweir:{name}{{"):
                values[key] += float(line.rsplit(" ", 1)[1])
    return values["draft"], values["accepted"]


@dataclass
class Server:
    label: str
    url: str
    ours: bool
    proc: subprocess.Popen
    model: str = ""


def run_interleaved(servers: list[Server], max_tokens: int) -> list[tuple[str, dict]]:
    """Every server answers each prompt in turn before the next prompt, so a drift of this shared machine's speed
    (1.5-2x between hours here) falls on every row alike instead of on whichever row ran during it."""
    for server in servers:
        server.model = llama_server_model(server.url)
        stream_chat(server.url, server.model, "Hello", 8)  # warm-up
    rows: dict[str, dict] = {server.label: {} for server in servers}
    for workload, prompts in WORKLOADS.items():
        before = {s.label: spec_counters(s.url) for s in servers if s.ours}
        results: dict[str, list[dict]] = {server.label: [] for server in servers}
        for i, prompt in enumerate(prompts):
            for server in servers:
                result = stream_chat(server.url, server.model, prompt, max_tokens)
                results[server.label].append(result)
                print(f"  [{server.label}] {workload} {i + 1}/{len(prompts)}: {result['tok_s']:.1f} tok/s", flush=True)
        for server in servers:
            answered = results[server.label]
            if server.ours:
                after = spec_counters(server.url)
                drafted, accepted = after[0] - before[server.label][0], after[1] - before[server.label][1]
            else:
                drafted = sum(r["timings"].get("draft_n", 0) for r in answered)
                accepted = sum(r["timings"].get("draft_n_accepted", 0) for r in answered)
            rows[server.label][workload] = {
                "tok_s": statistics.median(r["tok_s"] for r in answered),
                "tokens": sum(r["tokens"] for r in answered),
                "acceptance": accepted / drafted if drafted else None,
            }
    return list(rows.items())


def llama_server_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return orjson.loads(r.read())["data"][0]["id"]


def start_ours(label: str, path: str, threads: int, spec: str | None) -> Server:
    port = llama_server.free_port()
    cmd = [sys.executable, "-m", "tokenweir.engine.server", "--model", path, "--port", str(port),
           "--num-threads", str(threads), "--max-num-seqs", "4", "--log-level", "info",
           *(["--speculative-config", spec] if spec else [])]  # fmt: skip
    log_path = f"/tmp/tokenweir-bench-spec-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        llama_server.wait_healthy(proc, url, 600)
    except BaseException:
        stop(proc)
        raise
    return Server(label, url, True, proc)


def start_llama(label: str, path: str, threads: int, extra: list[str]) -> Server | None:
    binary = llama_server.build()
    if binary is None:
        return None
    try:
        proc, url = llama_server.start(binary, path, 1, threads, extra=extra)
    except RuntimeError as exc:  # e.g. a flag this llama.cpp does not take: its log says which
        print(f"llama-server {' '.join(extra)}: no row, {exc}", flush=True)
        return None
    return Server(label, url, False, proc)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def plot(rows: list[tuple[str, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    workloads = list(WORKLOADS)
    width = 0.8 / len(rows)
    for i, (name, row) in enumerate(rows):
        xs = [w + i * width for w in range(len(workloads))]
        values = [row[w]["tok_s"] for w in workloads]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([w + width * (len(rows) - 1) / 2 for w in range(len(workloads))], workloads)
    ax.set_ylabel("batch-1 decode tok/s (median)")
    ax.set_title("speculative decoding (ngram), greedy, one request at a time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--num-speculative-tokens", "-k", type=int, nargs="+", default=[4, 8], help="a row of ours per k")
    ap.add_argument("--plot", default="")
    args = ap.parse_args()
    path = args.model or default_model_path()
    ks = args.num_speculative_tokens
    servers: list[Server] = []
    try:  # all up at once (an idle server takes no CPU), asked in turn
        servers.append(start_ours("ours, plain", path, args.threads, None))
        for k in ks:
            servers.append(start_ours(f"ours, ngram k={k}", path, args.threads, ours_spec(k)))
        servers.append(start_ours(f"ours, ngram k={ks[0]}, every draft", path, args.threads, ours_spec(ks[0], False)))
        if not args.skip_llama:
            for name, extra in (("llama-server, plain", []), ("llama-server, ngram-simple", LLAMA_SPEC)):
                if (server := start_llama(name, path, args.threads, extra)) is not None:
                    servers.append(server)
        rows = run_interleaved(servers, args.max_tokens)
    finally:
        for server in servers:
            stop(server.proc)
    base = rows[0][1]
    print(f"\nthreads {args.threads}, max_tokens {args.max_tokens}, greedy, batch 1")
    print("| row | " + " | ".join(f"{w} tok/s | vs ours plain | acceptance" for w in WORKLOADS) + " |")
    print("|---|" + "---|---|---|" * len(WORKLOADS))
    for name, row in rows:
        cells = []
        for w in WORKLOADS:
            acceptance = row[w]["acceptance"]
            cells.append(f"{row[w]['tok_s']:.1f} | {row[w]['tok_s'] / base[w]['tok_s']:.2f}x | "
                         + ("-" if acceptance is None else f"{acceptance:.0%}"))  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
