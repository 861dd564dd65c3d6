"""The prefix-cache side channel, measured: can team B tell whether team A sent a prompt? `tokenweir serve` (one
engine, SmolLM2) per cache scope; team A sends a confidential system prompt, then team B probes it with the exact
prompt (a right guess) and with a wrong guess of the same length, each streamed with max_tokens 1. Per probe: the
`cached_tokens` the answer reports and the time to the first token at the client. Team A's second key then asks with
the same system prompt: how much of it comes from the cache (a team must keep its own hits).

    .venv/bin/python loadtests/bench_cache_isolation.py            # ~2-3 min on 2 cores
    .venv/bin/python loadtests/bench_cache_isolation.py --probes 9

Each probe uses a secret of its own (B's probes would otherwise hit B's own cache from its earlier probe). Rows:
`cache_scope: team` (the default) and `shared` (no salt: today's behaviour before scopes). The table goes to stdout
and loadtests/results/bench_cache_isolation.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadtests.bench_routing import MODEL, ROOT, Serve  # noqa: E402

WORDS = ("ledger", "harbor", "quartz", "meadow", "signal", "cobalt", "lantern", "orbit", "thistle", "vector")


def secret(rng: random.Random, sentences: int = 24) -> str:
    """A system prompt nobody else would send: seeded random words in a fixed frame (~400 tokens)."""
    body = " ".join(
        f"Rule {i}: when asked about {rng.choice(WORDS)}, mention {rng.choice(WORDS)} and {rng.choice(WORDS)}."
        for i in range(sentences)
    )
    return f"Confidential instructions for the finance assistant. {body}"


def probe(url: str, key: str, system: str, question: str) -> tuple[int, float]:
    """cached_tokens and the client's time to the first token of one streamed request (max_tokens 1)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {key}"}
    t0, ttft, cached = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached
    return cached, ttft or time.perf_counter() - t0


def run_scope(scope: str, probes: int, seed: int, tmp: Path) -> dict:
    config = {
        "events": {"path": str(tmp / f"{scope}.events.jsonl")},
        "engine": {"cache_scope": scope, "num_threads": 2, "extra_args": ["--quantization", "none"]},
    }
    path = tmp / f"{scope}.yaml"
    path.write_text(yaml.safe_dump(config))
    serve = Serve(path, 1, tmp / f"{scope}.db")
    try:
        serve.wait_ready()
        admin = {"authorization": f"Bearer {serve.admin_key()}"}
        keys = {}
        for team, names in (("team-a", ("a1", "a2")), ("team-b", ("b1",))):
            team_id = httpx.post(serve.url + "/admin/teams", json={"name": team}, headers=admin).json()["id"]
            for name in names:
                created = httpx.post(f"{serve.url}/admin/teams/{team_id}/keys", json={"name": name}, headers=admin)
                keys[name] = created.json()["secret"]
        rng = random.Random(seed)
        probe(serve.url, keys["b1"], secret(rng), "Warm-up.")  # the first request of a process is slower
        right, wrong, own = [], [], []
        for i in range(probes):
            confidential = secret(rng)
            probe(serve.url, keys["a1"], confidential, "What is rule 3?")  # team A's own use
            guess = secret(rng)  # a wrong guess: the same frame and length, other words
            wrong.append(probe(serve.url, keys["b1"], guess, f"Probe {i}."))
            right.append(probe(serve.url, keys["b1"], confidential, f"Probe {i}."))
            own.append(probe(serve.url, keys["a2"], confidential, f"Another question {i}."))
        prompt_len = len(confidential) // 4  # for the table only: ~4 characters a token
        return {"scope": scope, "right": right, "wrong": wrong, "own": own, "approx_prompt": prompt_len}
    finally:
        serve.stop()


def row(r: dict) -> str:
    def med(xs: list[tuple[int, float]], i: int) -> float:
        return statistics.median(x[i] for x in xs)

    ratio = med(r["right"], 1) / med(r["wrong"], 1)
    return (
        f"| {r['scope']} | {med(r['right'], 0):.0f} | {med(r['wrong'], 0):.0f} | {med(r['right'], 1) * 1000:.0f} "
        f"| {med(r['wrong'], 1) * 1000:.0f} | {ratio:.2f} | {med(r['own'], 0):.0f} | {med(r['own'], 1) * 1000:.0f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=5, help="secrets probed per scope (medians over them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "loadtests" / "results" / "bench_cache_isolation.md")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_cache_isolation_") as tmp:
        for scope in ("team", "shared"):
            print(f"[{scope}] serve + {args.probes} secrets, probed by team B and reused by team A's second key")
            results.append(run_scope(scope, args.probes, args.seed, Path(tmp)))
            print(f"[{scope}] done", flush=True)
    header = [
        "| cache_scope | B's right guess: cached tokens | B's wrong guess: cached | right guess TTFT ms "
        "| wrong guess TTFT ms | right / wrong TTFT | A's 2nd key: cached | A's 2nd key TTFT ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    md = [
        f"# bench_cache_isolation ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"`loadtests/bench_cache_isolation.py --probes {args.probes}`: one engine (SmolLM2-135M, dense, 2 threads), a "
        f"~{results[0]['approx_prompt']}-token confidential system prompt per probe; medians of {args.probes} probes. "
        "The side channel is closed where B's right guess reports what a wrong one does and is no faster.",
        "",
        *header,
        *(row(r) for r in results),
        "",
    ]
    text = "\n".join(md)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
