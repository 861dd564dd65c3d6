"""Structured-output overhead per output token: the same 16 prompts decoded as one batch, free and under a JSON
schema (grammar masks from engine/text/structured.py), in one run on one machine:

    .venv/bin/python loadtests/bench_structured.py --plot loadtests/results/bench_structured.png

The engine runs in process (the dtype and weight format `auto` picks here, as `tokenweir serve` would). Time per
output token is measured on full decode steps only (every one of the batch's sequences decoding, no prefill), so
both modes are compared at the same batch size: a JSON answer ends earlier than a free one, and a shrinking batch
would otherwise be billed to the grammar. The schema asks for long strings so both modes decode long enough.
Rounds alternate free / structured so drift on a shared machine hits both; the table gives medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenweir.engine.config import EngineConfig  # noqa: E402
from tokenweir.engine.core.llm_engine import LLMEngine  # noqa: E402
from tokenweir.engine.sched.sampling_params import SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 40, "maxLength": 80},
        "story": {"type": "string", "minLength": 300, "maxLength": 600},
        "mood": {"enum": ["happy", "sad", "calm"]},
    },
    "required": ["title", "story", "mood"],
}
TOPICS = ["a lighthouse", "a lost key", "the first snow", "a robot cook", "a night train", "an old map", "a garden",
          "a storm at sea", "a chess game", "a small dog", "a bakery", "the moon", "a violin", "a river", "a kite",
          "a library"]  # fmt: skip


def run_round(engine: LLMEngine, prompts: list[list[int]], structured: bool, max_tokens: int, tag: str) -> dict:
    spec = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}} if structured else None
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=not structured)
        params.structured = spec
        engine.validate(prompt, params)
        engine.add_request(f"{tag}-{i}", prompt, params)
    full_steps: list[float] = []
    tokens = 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        tokens += len(outputs)
        stats = engine.last_stats
        if stats.num_tokens == len(prompts) and stats.num_generation_tokens == len(prompts):
            full_steps.append(elapsed)
    return {"ms_per_step": 1000 * statistics.median(full_steps), "steps": len(full_steps), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--plot", default="")
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(max_model_len=1024, kv_cache_memory=256 * 2**20, max_num_seqs=16))
    print(f"engine: {engine.precision.reason}; batch {len(TOPICS)}, {args.rounds} rounds per mode", flush=True)
    tok = engine.tokenizer
    prompts = [
        tok.encode_chat([{"role": "user", "content": f"Write a short story about {t} as JSON with a title."}])
        for t in TOPICS
    ]
    engine.structured.compile({"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}})
    run_round(engine, prompts, False, 8, "warm")  # first-step allocations out of the way
    results: dict[str, list[dict]] = {"free": [], "json_schema": []}
    for r in range(args.rounds):
        for mode in results:
            res = run_round(engine, prompts, mode == "json_schema", args.max_tokens, f"{mode}-{r}")
            results[mode].append(res)
            print(f"  round {r + 1}/{args.rounds} {mode:<11} {res['ms_per_step']:.1f} ms/step "
                  f"over {res['steps']} full steps", flush=True)  # fmt: skip

    batch = len(prompts)
    rows = []
    for mode, rounds in results.items():
        ms = statistics.median(r["ms_per_step"] for r in rounds)
        rows.append((mode, ms, 1000 * batch / ms, sum(r["steps"] for r in rounds)))
    base = rows[0][1]
    print("\n| mode | batch | ms per step (median) | ms per output token | out tok/s | full steps | vs free |")
    print("|---|---|---|---|---|---|---|")
    for mode, ms, tps, steps in rows:
        change = 100 * (ms / base - 1)
        print(f"| {mode} | {batch} | {ms:.1f} | {ms / batch:.2f} | {tps:.1f} | {steps} | {change:+.1f}% |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar([r[0] for r in rows], [r[1] / batch for r in rows], color=["#4c72b0", "#dd8452"])
        for i, r in enumerate(rows):
            label = f"{r[1] / batch:.2f} ms\n{100 * (r[1] / base - 1):+.1f}%"
            ax.text(i, r[1] / batch, label, ha="center", va="bottom")
        ax.set_ylabel("ms per output token (batch 16)")
        ax.set_title("Structured-output overhead")
        ax.set_ylim(0, max(r[1] for r in rows) / batch * 1.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
