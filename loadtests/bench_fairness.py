"""Goodput per team under three ways of sharing a pool: first come first served, today's stride over requests, and
fairness by weighted tokens (VTC), on the same seeded open-loop schedule (loadtests/fairness_workload.py: a heavy
team at 5x an interactive team's request rate, and a batch-band team).

    .venv/bin/python loadtests/bench_fairness.py            # against 2 fake engines (the gateway alone): ~4 min
    .venv/bin/python loadtests/bench_fairness.py --quick    # ~2 min
    .venv/bin/python loadtests/bench_fairness.py --engine   # `tokenweir serve --engines 2` (SmolLM2): ~8 min

The fake engines take the time a real one would (a prefill time per prompt word, an inter-token latency per output
token) but never slow each other down: the pool's `capacity` dispatch slots are the contention, so what differs
between rows is the gateway's queue order alone. With --engine the engines are real (the engine's own scheduler shares
its batch by the fairness id the gateway sends). Per policy: each team's goodput (requests/s meeting its TTFT and TPOT
SLO), requests ok / sent, TTFT p50 / p90, weighted tokens served; between the heavy and interactive teams while both
were queued, Jain's index of their service and the largest service gap over any such interval against VTC's bound;
where the prefix router sent the prompts (and the engines' prefix-cache hit rate), and output tokens per second. A
table to stdout and loadtests/results/bench_fairness.md (bench_fairness_engine.md), a plot beside it; the issue's
targets are checked, not assumed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: make `loadtests` and `tests` importable

from loadtests import fairness_workload as work  # noqa: E402

POLICIES = ("fcfs", "requests", "tokens")
FAKE_SERVICE = {"prefill_ms_per_word": 0.2, "itl_ms": 10.0}
BLOCK_SIZE = 16


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            flags = next(line for line in info if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor() or "?"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
    return " ".join(f for f in wanted if f in flags)


def teams(store, all_shapes: list[work.Shape]) -> dict[str, str]:
    from tokenweir.policies.limits import TeamLimits

    keys = {}
    for shape in all_shapes:
        team = store.create_team(shape.team, TeamLimits(priority=shape.priority, queue_timeout_s=120))
        keys[shape.team], _ = store.create_key(team.id, shape.team)
    return keys


def run_fake(policy: str, plan, all_shapes, duration_s: float, capacity: int, tmp: Path) -> work.Summary:
    """One policy through an in-process gateway in front of two fake engines."""
    from loadtests.fake_upstream import FakeUpstream
    from tests.support.serve_thread import ServerThread, serve_app
    from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
    from tokenweir.gateway.store.store import Store

    events = tmp / f"{policy}.events.jsonl"
    store = Store.open(f"sqlite:///{tmp}/{policy}.db")
    keys = teams(store, all_shapes)
    fakes = [FakeUpstream(model="m", block_size=BLOCK_SIZE, max_model_len=8192) for _ in range(2)]
    with ServerThread(fakes[0]) as a, ServerThread(fakes[1]) as b:
        members = [UpstreamConfig(a.url, engine=True, name="e0"), UpstreamConfig(b.url, engine=True, name="e1")]
        pool = PoolConfig(
            model="m", upstreams=members, tokenizer="default", capacity=capacity, max_queued=4096, fairness=policy
        )
        config = GatewayConfig(
            port=0,
            pools=[pool],
            events=EventsConfig(path=str(events), flush_interval_s=0.05),
            load_poll_interval_s=0.25,
        )
        with serve_app(config, store=store) as gw:
            t0 = time.perf_counter()
            records = asyncio.run(work.run(gw.url, keys, plan, "m", FAKE_SERVICE, policy))
            wall = time.perf_counter() - t0
            time.sleep(0.5)  # the last events' lines
    store.close()
    work.read_events(records, events.read_bytes().splitlines())
    summary = work.summarize(policy, records, all_shapes, duration_s, capacity)
    print(f"[{policy:>8}] {len(records)} requests in {wall:.0f}s: " + progress(summary), flush=True)
    return summary


def run_engine(policy: str, plan, all_shapes, duration_s: float, capacity: int, tmp: Path) -> work.Summary:
    """One policy through `tokenweir serve --engines 2` (its own gateway, store and engines)."""
    import yaml

    from loadtests.bench_routing import Serve

    events = tmp / f"{policy}.events.jsonl"
    config = {
        "events": {"path": str(events)},
        "load_poll_interval_s": 0.25,
        "engine": {
            "num_threads": 2,
            "fairness": policy,
            "capacity": capacity,
            # fewer sequences per engine than the pool lets in: each engine's own queue orders the rest (by the
            # fairness id the gateway sends, with fairness tokens)
            "extra_args": ["--quantization", "none", "--max-num-seqs", "2"],
        },
    }
    path = tmp / f"{policy}.yaml"
    path.write_text(yaml.safe_dump(config))
    serve = Serve(path, 2, tmp / f"{policy}.db")
    try:
        serve.wait_ready()
        keys = serve.team_keys(
            {shape.team: {"priority": shape.priority, "queue_timeout_s": 300} for shape in all_shapes}
        )
        t0 = time.perf_counter()
        records = asyncio.run(work.run(serve.url, keys, plan, "smollm2-135m", None, policy))
        wall = time.perf_counter() - t0
        time.sleep(1.0)
    finally:
        serve.stop()
    work.read_events(records, events.read_bytes().splitlines())
    summary = work.summarize(policy, records, all_shapes, duration_s, capacity)
    print(f"[{policy:>8}] {len(records)} requests in {wall:.0f}s: " + progress(summary), flush=True)
    return summary


def progress(s: work.Summary) -> str:
    return ", ".join(f"{t} goodput {g:.3f}/s ({s.ok[t]}/{s.sent[t]} ok)" for t, g in s.goodput.items())


def table(rows: list[work.Summary], all_shapes: list[work.Shape]) -> str:
    names = [sh.team for sh in all_shapes]
    head = (
        "| policy | "
        + " | ".join(f"{t} goodput/s" for t in names)
        + " | "
        + " | ".join(f"{t} ok/sent" for t in names)
        + " | "
        + " | ".join(f"{t} TTFT p50/p90 s" for t in names)
        + " | "
        + " | ".join(f"{t} served (wtok)" for t in names)
        + " | Jain (heavy, interactive, both queued) | max gap heavy-interactive / VTC bound | on the prefix's instance"
        + " | engine prefix hit rate | output tok/s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in rows:
        cells = [s.policy]
        cells += [f"{s.goodput[t]:.3f}" for t in names]
        cells += [f"{s.ok[t]}/{s.sent[t]}" for t in names]
        cells += [f"{s.ttft_p50[t]:.2f}/{s.ttft_p90[t]:.2f}" for t in names]
        cells += [f"{s.served[t]}" for t in names]
        cells += [f"{s.jain:.3f}", f"{s.max_gap:.0f} / {s.bound:.0f}", f"{s.locality:.1%}", f"{s.hit_rate:.1%}"]
        cells += [f"{s.output_tok_s:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows: dict[str, work.Summary]) -> list[tuple[str, bool, str]]:
    old, new = rows["requests"], rows["tokens"]
    interactive = (
        new.goodput["interactive"] / old.goodput["interactive"] if old.goodput["interactive"] else float("inf")
    )
    throughput = new.output_tok_s / old.output_tok_s if old.output_tok_s else float("nan")
    # the engines' own hit rate where they report one (real engines); else where the router sent the prompts
    hits = new.hit_rate / old.hit_rate if old.hit_rate else new.locality / old.locality if old.locality else 0.0
    return [
        ("interactive goodput, tokens vs requests >= 2x", interactive >= 2, f"{interactive:.2f}x"),
        ("output throughput, tokens vs requests >= 0.9x", throughput >= 0.9, f"{throughput:.2f}x"),
        ("service gap within VTC's bound (tokens)", new.max_gap <= new.bound, f"{new.max_gap:.0f} <= {new.bound:.0f}"),
        ("prefix hit rate (fakes: locality), tokens vs requests >= 0.9x", hits >= 0.9, f"{hits:.2f}x"),
    ]


def plot(rows: list[work.Summary], all_shapes: list[work.Shape], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [sh.team for sh in all_shapes]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.8 / len(rows)
    for i, s in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(names))]
        axes[0].bar(xs, [s.goodput[t] for t in names], width, label=s.policy)
        axes[1].bar(xs, [s.ttft_p90[t] for t in names], width, label=s.policy)
    for ax, what in zip(axes[:2], ("goodput (requests/s meeting the SLO)", "TTFT p90 (s)"), strict=True):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(what)
        ax.legend()
    axes[1].set_yscale("log")
    axes[2].bar([s.policy for s in rows], [max(s.max_gap, 1.0) for s in rows], color="tab:purple")
    axes[2].axhline(rows[-1].bound, color="black", linestyle="--", label="VTC bound (2U + in-flight output)")
    axes[2].set_yscale("log")
    axes[2].set_title("largest service gap heavy-interactive while both queued (wtok)")
    axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", action="store_true", help="real engines (`serve --engines 2`) instead of fakes")
    ap.add_argument("--quick", action="store_true", help="a shorter schedule (a smoke run)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default 60, --quick 25)")
    ap.add_argument("--capacity", type=int, default=None, help="the pool's dispatch slots (default 2, --engine 6)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args()
    duration = args.duration or (25.0 if args.quick else 60.0)
    all_shapes = work.shapes(args.engine)
    args.capacity = args.capacity or (6 if args.engine else 2)
    plan = work.schedule(all_shapes, duration, args.seed)
    where = "2 SmolLM2 engines (`serve --engines 2`)" if args.engine else "2 fake engines"
    print(f"bench_fairness: {len(plan)} requests over {duration:g}s through {where}, pool capacity {args.capacity}")
    runner = run_engine if args.engine else run_fake
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_fairness_") as tmp:
        for policy in args.policies.split(","):
            rows.append(runner(policy, plan, all_shapes, duration, args.capacity, Path(tmp)))
    by_name = {s.policy: s for s in rows}
    checks = targets(by_name) if {"requests", "tokens"} <= set(by_name) else []
    shapes_md = "; ".join(
        f"{sh.team}: ~{sh.system_words + sh.question_words} words in, {sh.output_tokens} out, "
        f"{sh.bursts_per_s * sh.burst:.3g} req/s{f' in bursts of {sh.burst}' if sh.burst > 1 else ''}, band "
        f"{sh.priority}, SLO TTFT <= {sh.slo_ttft_s:g}s and TPOT <= {sh.slo_tpot_s * 1000:g}ms"
        for sh in all_shapes
    )
    service = "" if args.engine else f" Fake service: {FAKE_SERVICE['prefill_ms_per_word']} ms per prompt word, "
    service += "" if args.engine else f"{FAKE_SERVICE['itl_ms']:g} ms per output token."
    text = "\n".join(
        [
            f"# bench_fairness ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
            "",
            f"`{' '.join(['loadtests/bench_fairness.py', *sys.argv[1:]])}`: {len(plan)} requests over {duration:g}s "
            f"(seed {args.seed}) through {where}, pool capacity {args.capacity}. {shapes_md}.{service} CPU: "
            f"{os.cpu_count()} cores ({cpu_flags()}). wtok: prompt + 2 x output tokens.",
            "",
            table(rows, all_shapes),
            "",
            "| target | met | measured |",
            "|---|---|---|",
            *(f"| {what} | {'met' if ok else 'NOT met'} | {got} |" for what, ok, got in checks),
            "",
        ]
    )
    print("\n" + text)
    out = ROOT / "loadtests" / "results" / ("bench_fairness_engine" if args.engine else "bench_fairness")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    plot(rows, all_shapes, out.with_suffix(".png"), f"bench_fairness: {where}, capacity {args.capacity}")
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
