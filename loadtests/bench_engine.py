"""Engine throughput benchmark: our engine vs HF transformers static batching, same machine, same process.

    .venv/bin/python loadtests/bench_engine.py            # full workload (several minutes on 2 CPU cores)
    .venv/bin/python loadtests/bench_engine.py --quick    # 16 requests, shorter lengths

Workload (seeded): N requests, prompt lengths uniform in [32, 1024], outputs in [16, 256] tokens with ignore_eos, so
both sides produce exactly the same number of tokens. A shared-prefix variant gives every prompt one common 512-token
prefix. HF runs static batches of 16 with left padding and generates until the longest request of its batch is done
(that is what static batching costs); only requested tokens count as output. Also prints batch-1 decode speed and our
decode step time against the memory roofline (weight bytes / measured read bandwidth).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from engine.config import EngineConfig, default_model_path
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def make_workload(n: int, seed: int, min_prompt: int, max_prompt: int, min_out: int, max_out: int, shared: int):
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 49000) for _ in range(shared)]
    work = []
    for _ in range(n):
        plen = rng.randint(min_prompt, max_prompt)
        prompt = prefix + [rng.randrange(100, 49000) for _ in range(max(plen - shared, 1))]
        work.append((prompt, rng.randint(min_out, max_out)))
    return work


def run_ours(engine: LLMEngine, work, label: str) -> tuple[float, int]:
    for i, (prompt, out_len) in enumerate(work):
        engine.add_request(f"{label}-{i}", prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    start = time.perf_counter()
    produced, steps, last_print = 0, 0, start
    while engine.has_unfinished_requests():
        produced += len(engine.step())
        steps += 1
        if time.perf_counter() - last_print > 5:
            last_print = time.perf_counter()
            print(f"  [{label}] {produced} tokens, {steps} steps, {last_print - start:.0f}s", flush=True)
    return time.perf_counter() - start, produced


def run_hf(hf, work, batch_size: int, pad_id: int) -> tuple[float, int]:
    start = time.perf_counter()
    produced = 0
    for b in range(0, len(work), batch_size):
        batch = work[b : b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        longest = max(o for _, o in batch)
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
        produced += sum(o for _, o in batch)
        print(
            f"  [hf] batch {b // batch_size + 1}/{-(-len(work) // batch_size)}: {time.perf_counter() - start:.0f}s",
            flush=True,
        )
    return time.perf_counter() - start, produced


def read_bandwidth() -> float:
    x = torch.ones(256 * 2**20 // 4)  # 256 MiB, far past the caches
    x.sum()
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        x.sum()
    return reps * x.numel() * 4 / (time.perf_counter() - start)


def batch1_decode(engine: LLMEngine, steps: int = 64) -> float:
    engine.add_request("b1", [100] * 32, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    engine.step()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return steps / (time.perf_counter() - start)


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{name}\n{wl}" for name, wl, _, _ in rows]
    values = [tok / t for _, _, tok, t in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar(labels, values, color=["#2b6cb0", "#2f855a", "#68d391", "#a0aec0"][: len(rows)])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens / s")
    ax.set_title("SmolLM2-135M, float32, same CPU, same process")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="16 requests, prompts 32-256, outputs 16-64")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--plot", default="", help="also draw the throughput table as a bar chart (PNG path)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, pmax, omax = (16, 256, 64) if args.quick else (args.requests, 1024, 256)
    path = args.model or default_model_path()
    cfg = dict(
        model=path, max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=6 * 2**30
    )
    engine = LLMEngine(EngineConfig(**cfg), progress=True)
    mixed = make_workload(n, args.seed, 32, pmax, 16, omax, shared=0)
    shared = make_workload(n, args.seed + 1, 32 + 512, pmax + 512, 16, omax, shared=512)
    rows = []

    bw = read_bandwidth()
    weight_bytes = sum(
        t.numel() * t.element_size()
        for layer in engine.model.layers
        for t in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    )
    weight_bytes += engine.model.lm_head.numel() * engine.model.lm_head.element_size()
    roofline = bw / weight_bytes
    b1 = batch1_decode(engine)

    t, tok = run_ours(engine, mixed, "ours-mixed")
    rows.append(("ours", "mixed", tok, t))
    t, tok = run_ours(engine, shared, "ours-shared")
    rows.append(("ours (prefix cache)", "shared-prefix", tok, t))
    engine_nc = LLMEngine(EngineConfig(**cfg, enable_prefix_caching=False))
    t, tok = run_ours(engine_nc, shared, "ours-shared-nocache")
    rows.append(("ours (no prefix cache)", "shared-prefix", tok, t))
    del engine_nc
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            path.rsplit("/", 1)[0], gguf_file=path.rsplit("/", 1)[1], dtype=torch.float32
        ).eval()
        t, tok = run_hf(hf, mixed, args.hf_batch, pad_id=2)
        rows.append((f"HF static batch {args.hf_batch}", "mixed", tok, t))

    print(f"\n{'system':<26}{'workload':<15}{'out tokens':>11}{'seconds':>9}{'out tok/s':>11}")
    for name, wl, tok, t in rows:
        print(f"{name:<26}{wl:<15}{tok:>11}{t:>9.1f}{tok / t:>11.1f}")
    if not args.skip_hf:
        ours, hf_row = rows[0], rows[-1]
        print(f"\nthroughput ratio ours / HF static (mixed): {(ours[2] / ours[3]) / (hf_row[2] / hf_row[3]):.2f}x")
    print(f"prefix cache speed-up (shared-prefix): {rows[2][3] / rows[1][3]:.2f}x")
    if args.plot:
        plot(rows, args.plot)
    print(f"\nbatch-1 decode: {b1:.1f} tok/s ({1000 / b1:.1f} ms/step)")
    print(
        f"memory roofline: {weight_bytes / 2**20:.0f} MiB of weights read per step at {bw / 1e9:.1f} GB/s "
        f"-> {roofline:.1f} tok/s; ours is {100 * b1 / roofline:.0f}% of it"
    )


if __name__ == "__main__":
    main()
