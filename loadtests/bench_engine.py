"""Engine benchmark against the peers a CPU user would pick, one at a time, in one run on one machine:

    .venv/bin/python loadtests/bench_engine.py --plot loadtests/results/bench_engine.png
    .venv/bin/python loadtests/bench_engine.py --quick          # prompts 32-256, outputs 16-64
    .venv/bin/python loadtests/bench_engine.py --batch-invariant --skip-hf --skip-llama   # that flag's cost

Rows: our engine server in float32 and in `auto` (the dtype and weight format it picks for this CPU, printed),
llama-server (built once from the llama.cpp vendored in the llama-cpp-python sdist, see loadtests/llama_server.py;
skipped with the reason where the build fails) on the same GGUF, and HF transformers in process (static batches and
batch 1). Served systems get the same workload over HTTP: 16 seeded requests, prompts 32-1024 tokens, outputs 16-256
(ignore_eos, greedy), all sent at once and streamed, so TTFT and time per output token are what a client sees; before
them, one request alone three times for batch-1 decode speed (the median). Each server gets the machine to itself
(llama-server's spin-waiting threads collapse when anything else runs on the cores). Also prints each weight format's
memory roofline: the bytes a decode step must read over the bandwidth measured here.

The AVX2 class on a machine that has more: `TOKENWEIR_CPU_ISA=avx2 .venv/bin/python loadtests/bench_engine.py ...`
runs our engine with its kernels built for AVX2 only and its AVX-512/VNNI/bf16 choices off (kernels/cpu/ops.py), and
llama-server built for AVX2 only (loadtests/llama_server.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request

import httpx
import orjson
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loadtests import llama_server  # noqa: E402
from tokenweir.common.text.model_files import default_model_path  # noqa: E402
from tokenweir.engine.model.precision import cpu_flags  # noqa: E402
from tokenweir.kernels.cpu import ops as cpu_ops  # noqa: E402

CONCURRENCY = 16


def make_workload(n: int, seed: int, prompt_range: tuple[int, int], out_range: tuple[int, int]):
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, 49000) for _ in range(rng.randint(*prompt_range))], rng.randint(*out_range))
        for _ in range(n)
    ]


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.perf_counter()
    first = last = None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("choices") and (chunk["choices"][0].get("text") or chunk["choices"][0].get("content")):
                last = time.perf_counter()
                first = first or last
    assert first is not None, "the stream carried no text"
    return {"ttft": first - sent, "tpot": (last - first) / max(max_tokens - 1, 1), "end": last, "tokens": max_tokens}


async def run_served(url: str, model: str, work, label: str) -> dict:
    # A connection per request: llama-server closes an idle kept-alive connection as httpx sends the next request on
    # it ("Server disconnected without sending a response", then our SIGTERM's "cleaning up before exit" in its log).
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        # A short warm-up request: first-call costs (thread pools, kernel packing) are not what we measure.
        await stream_one(client, url, model, work[0][0][:16], 4)
        # Batch 1 first, on an idle server.
        # The median of three: one 129-token request varies by +-15% here, llama-server's most.
        alone = sorted([await stream_one(client, url, model, work[0][0][:32], 129) for _ in range(3)],
                       key=lambda r: r["tpot"])[1]  # fmt: skip
        start = time.perf_counter()
        done = 0

        async def tracked(prompt, out):
            nonlocal done
            result = await stream_one(client, url, model, prompt, out)
            done += 1
            print(f"  [{label}] {done}/{len(work)} done at {time.perf_counter() - start:.0f}s", flush=True)
            return result

        results = await asyncio.gather(*(tracked(p, o) for p, o in work[:CONCURRENCY]))
        elapsed = max(r["end"] for r in results) - start
    ttfts = sorted(r["ttft"] for r in results)
    return {
        "tok_s": sum(r["tokens"] for r in results) / elapsed,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "tpot_p50": statistics.median(r["tpot"] for r in results) * 1000,
        "b1": 1 / alone["tpot"],
    }


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return orjson.loads(r.read())["data"][0]["id"]


def measure_ours(
    model_path: str,
    dtype: str,
    quantization: str,
    threads: int,
    work,
    policy: str = "fcfs",
    batch_invariant: bool = False,
) -> tuple[dict, str]:
    port = llama_server.free_port()
    cmd = [
        sys.executable, "-m", "tokenweir.engine.server", "--model", model_path, "--port", str(port), "--dtype", dtype,
        "--quantization", quantization, *(["--num-threads", str(threads)] if threads else []),
        "--max-num-seqs", str(CONCURRENCY), "--scheduling-policy", policy,
        "--kv-cache-memory", "2GiB", "--log-level", "info",
        *(["--batch-invariant"] if batch_invariant else []),
    ]  # fmt: skip
    log_path = f"/tmp/tokenweir-bench-engine-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        llama_server.wait_healthy(proc, url, 600)
        with open(log_path) as f:
            precision = next((line for line in f if "precision:" in line), "")
        reason = precision.split("precision:", 1)[1].split('"')[0].strip() if precision else "?"
        return asyncio.run(run_served(url, served_model(url), work, f"ours {dtype}/{quantization}")), reason
    finally:
        proc.terminate()
        proc.wait(30)


def measure_llama(model_path: str, threads: int, work) -> dict | None:
    binary = llama_server.build()
    if binary is None:
        return None
    proc, url = llama_server.start(binary, model_path, CONCURRENCY, threads)
    try:
        return asyncio.run(run_served(url, served_model(url), work, "llama-server"))
    except httpx.HTTPError as exc:  # it went away mid-run: say so and keep the other rows
        print(f"  llama-server: no row, it failed mid-run ({type(exc).__name__}: {exc}); see its log above", flush=True)
        return None
    finally:
        proc.terminate()
        proc.wait(30)


def measure_hf(model_path: str, work, batch_size: int = CONCURRENCY) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_path.rsplit("/", 1)[0], gguf_file=model_path.rsplit("/", 1)[1], dtype=torch.float32
    ).eval()
    batch = work[:batch_size]
    width = max(len(p) for p, _ in batch)
    ids = torch.full((len(batch), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(batch):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    longest = max(o for _, o in batch)
    print(f"  [hf] static batch of {len(batch)}, {longest} steps", flush=True)
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                    pad_token_id=2)  # fmt: skip
    elapsed = time.perf_counter() - start
    one = torch.tensor([work[0][0][:32]])
    with torch.inference_mode():
        hf.generate(one, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=2)
        t = time.perf_counter()
        hf.generate(one, max_new_tokens=129, min_new_tokens=129, do_sample=False, pad_token_id=2)
        b1 = 129 / (time.perf_counter() - t)
    return {"tok_s": sum(o for _, o in batch) / elapsed, "b1": b1}


def read_bandwidth() -> float:
    x = torch.ones(256 * 2**20 // 4)  # 256 MiB, far past the caches
    x.sum()
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        x.sum()
    return reps * x.numel() * 4 / (time.perf_counter() - start)


def weight_params(model_path: str) -> int:
    """Parameters one decode step reads: every projection of every layer and the LM head (embeddings are lookups)."""
    from gguf import GGUFReader

    reader = GGUFReader(model_path)
    names = {t.name: t for t in reader.tensors}
    total = sum(int(t.n_elements) for n, t in names.items() if n.startswith("blk.") and n.endswith("weight")
                and "norm" not in n)  # fmt: skip
    head = names.get("output.weight") or names["token_embd.weight"]
    return total + int(head.n_elements)


def plot(rows: list[tuple[str, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = [name for name, _ in rows]
    colors = ["#a0aec0", "#2b6cb0", "#2f855a", "#dd6b20", "#718096"][: len(rows)]
    for ax, key, title in (
        (axes[0], "tok_s", f"output tok/s, {CONCURRENCY} concurrent"),
        (axes[1], "b1", "batch-1 decode tok/s"),
        (axes[2], "ttft_p50", "TTFT p50 (s), lower is better"),
    ):
        values = [r.get(key) or 0 for _, r in rows]
        bars = ax.bar(range(len(rows)), values, color=colors)
        ax.bar_label(bars, labels=[f"{r[key]:.1f}" if key in r else "n/a" for _, r in rows])
        ax.set_xticks(range(len(rows)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
    fig.suptitle("SmolLM2-135M (Q4_1 GGUF), same CPU, one system at a time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--quick", action="store_true", help="prompts 32-256, outputs 16-64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's -t and HF's threads")
    ap.add_argument("--engine-threads", type=int, default=0, help="ours; 0 = its serving default (every core)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-f32", action="store_true", help="no float32 row of ours")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--plot", default="", help="also draw the table (PNG path)")
    ap.add_argument(
        "--scheduling-policy", nargs="+", default=["fcfs"], choices=["fcfs", "shortest-prompt"],
        help="our auto row once per policy (the first is the one compared with llama-server's row)",
    )  # fmt: skip
    ap.add_argument(
        "--batch-invariant", action="store_true",
        help="also our auto row with --batch-invariant (its cost: the ratio to the plain auto row is printed)",
    )  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    work = make_workload(CONCURRENCY, args.seed, (32, 256) if args.quick else (32, 1024),
                         (16, 64) if args.quick else (16, 256))  # fmt: skip
    print(f"workload: {len(work)} requests, {sum(len(p) for p, _ in work)} prompt and {sum(o for _, o in work)} output "
          f"tokens; threads {args.threads}", flush=True)  # fmt: skip
    simd = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    print(f"CPU class: {cpu_ops.cpu_isa()} (TOKENWEIR_CPU_ISA, llama-server built to match); flags: {' '.join(simd)}")
    rows: list[tuple[str, dict]] = []
    if not args.skip_f32:
        f32, _ = measure_ours(path, "float32", "none", args.engine_threads, work)
        rows.append(("tokenweir engine (f32)", f32))
    autos = {}
    for policy in args.scheduling_policy:
        autos[policy], reason = measure_ours(path, "auto", "auto", args.engine_threads, work, policy)
        label = "auto" if len(args.scheduling_policy) == 1 else f"auto, {policy}"
        rows.append((f"tokenweir engine ({label})", autos[policy]))
    invariant = None
    if args.batch_invariant:
        invariant, _ = measure_ours(path, "auto", "auto", args.engine_threads, work, batch_invariant=True)
        rows.append(("tokenweir engine (auto, --batch-invariant)", invariant))
    llama = None if args.skip_llama else measure_llama(path, args.threads, work)
    if llama:
        rows.append(("llama-server (Q4_1)", llama))
    if not args.skip_hf:
        rows.append(("HF transformers (f32, static)", measure_hf(path, work)))

    print(f"\nauto chose: {reason}\n")
    print("| system | out tok/s | TTFT p50 / p99 s | TPOT p50 ms | batch-1 decode tok/s |\n|---|---|---|---|---|")
    for name, r in rows:
        ttft = f"{r['ttft_p50']:.1f} / {r['ttft_p99']:.1f}" if "ttft_p50" in r else "-"
        tpot = f"{r['tpot_p50']:.0f}" if "tpot_p50" in r else "-"
        print(f"| {name} | {r['tok_s']:.1f} | {ttft} | {tpot} | {r['b1']:.1f} |")
    if llama:
        for policy, row in autos.items():
            b1, tok, ttft = (row[k] / llama[k] for k in ("b1", "tok_s", "ttft_p50"))
            print(f"\nauto ({policy}) / llama-server: batch-1 {b1:.2f}x, throughput {tok:.2f}x, TTFT p50 {ttft:.2f}x")
        print("targets: batch-1 >= 1, throughput >= 2, TTFT p50 <= 0.33")
    else:
        print("\nllama-server: no row (see above for why)")
    if invariant:
        plain = autos[args.scheduling_policy[0]]
        b1, tok, ttft = (invariant[k] / plain[k] for k in ("b1", "tok_s", "ttft_p50"))
        print(f"--batch-invariant / auto: batch-1 {b1:.2f}x, throughput {tok:.2f}x, TTFT p50 {ttft:.2f}x")

    bw, params = read_bandwidth(), weight_params(path)
    gguf_bytes = os.path.getsize(path)
    print(f"\nmemory roofline at {bw / 1e9:.1f} GB/s measured, {params / 1e6:.0f}M weights read per decode step:")
    for fmt, nbytes in (("float32", params * 4), ("int8 (+ a float32 scale per 32)", params * 1.125),
                        ("Q4_1 GGUF (whole file)", gguf_bytes)):  # fmt: skip
        print(f"  {fmt:<34} {nbytes / 2**20:6.0f} MiB/step -> {bw / nbytes:6.1f} tok/s at batch 1")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
