"""Prefix-cache-aware routing, proven on the real thing: `tokenweir serve --engines 2` on SmolLM2, the same
interleaved requests of four teams (distinct ~450-token system prompts, short user turns) once with the pool's route
`prefix` and once with `round_robin` (`engine.route` in a config file per run).

With `prefix` each team stays on one engine and both engines take teams; the engines' own prefix-cache hit counters
(their /metrics, summed, deltas over the run) come out at least twice round robin's. Each engine's KV pool holds
about two teams' prefixes, not four: prefix routing splits the teams' working set between the engines, round robin
sends every team to both and they evict each other (what the cache-aware route is for). Without that bound both
engines would end up holding every prefix under round robin, and the gap would only be the warm-up of the second.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from gateway.events import read_events
from loadtests.fake_upstream import free_port
from tests.serve_process import serve_process
from tests.test_serve_engines import TEAMS, Output, engine_of, metric_value, stop_serve, system_prompt, wait_for

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
ROUNDS = 4
# 16-token blocks: a team's prompt is ~29 of them; 80 hold two teams' prefixes and a request in flight, not four.
KV_BLOCKS = 80
HITS, QUERIES = "tokenweir:prefix_cache_hits_total", "tokenweir:prefix_cache_queries_total"


def schedule() -> list[tuple[int, str]]:
    """(round, team), interleaved, each round's order rotated by one: under round robin over two engines a team's
    requests alternate between them (a fixed order would keep each team on one engine by parity alone)."""
    return [(r, TEAMS[(r + i) % len(TEAMS)]) for r in range(ROUNDS) for i in range(len(TEAMS))]


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """Prefix-cache (hit, queried) prompt tokens, summed over the engines' own /metrics."""
    hits = queries = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=5).text
        hits += metric_value(text, HITS, model_name=MODEL) or 0.0
        queries += metric_value(text, QUERIES, model_name=MODEL) or 0.0
    return hits, queries


def run_workload(tmp_path: Path, route: str) -> tuple[dict[str, list[str]], float, float, Counter]:
    """One `serve --engines 2` with the pool's `route`: team -> engine of each request, the prefix-cache hit and
    query token deltas over the run, and the events' route reasons."""
    work = tmp_path / route
    work.mkdir()
    events_path = work / "events.jsonl"
    config = {
        "events": {"path": str(events_path)},
        "load_poll_interval_s": 0.25,
        "engine": {
            "route": route,
            "num_threads": 2,  # one torch thread per engine child
            # dense weights (no start-up int8 probe), and a KV pool for about two teams' prefixes
            "extra_args": ["--quantization", "none", "--num-kv-blocks", str(KV_BLOCKS)],
        },
    }
    config_path = work / "tokenweir.yaml"
    config_path.write_text(yaml.safe_dump(config))
    args = ["--config", str(config_path), "--port", str(free_port()), "--engine-port", str(free_port())]
    args += ["--engines", "2", "--store", f"sqlite:///{work / 'tw.db'}"]
    with serve_process(args, timeout_s=240) as served:
        out = Output(served.proc, served.output)
        try:
            engines = out.engines()
            assert sorted(engines) == [0, 1], out.read()
            urls = [engines[i][1] for i in (0, 1)]
            client = openai.OpenAI(base_url=served.url + "/v1", api_key=served.demo_key, max_retries=0, timeout=120)
            hits0, queries0 = prefix_counters(urls)
            rids: dict[str, str] = {}
            for round_, team in schedule():
                rid = f"{route}-r{round_}-{team}-{uuid.uuid4().hex[:8]}"
                chat = client.chat.completions.create(
                    model=MODEL,
                    messages=[
                        {"role": "system", "content": system_prompt(team)},
                        {"role": "user", "content": f"Hi, this is question {round_ + 1}."},
                    ],
                    max_tokens=4,
                    temperature=0,
                    extra_headers={"x-request-id": rid},
                )
                assert chat.choices[0].message.content is not None
                rids[rid] = team
            hits1, queries1 = prefix_counters(urls)

            def all_events():
                found = {e["request_id"]: e for e in read_events(events_path) if e["request_id"] in rids}
                return found if len(found) == len(rids) else None

            events = wait_for("every request's event", all_events, 15)
        finally:
            stop_serve(served, out)
    placed: dict[str, list[str]] = {team: [] for team in TEAMS}
    reasons: Counter = Counter()
    for rid, team in rids.items():  # in the order sent
        e = events[rid]
        assert e["status"] == "ok", e
        placed[team].append(engine_of(e))
        reasons[(e.get("route_reason") or {}).get("reason")] += 1
    return placed, hits1 - hits0, queries1 - queries0, reasons


def test_prefix_routing_keeps_teams_on_one_engine_and_doubles_the_engines_cache_hits(tmp_path):
    t0 = time.monotonic()
    placed, hits, queries, reasons = run_workload(tmp_path, "prefix")
    t1 = time.monotonic()
    rr_placed, rr_hits, rr_queries, rr_reasons = run_workload(tmp_path, "round_robin")
    t2 = time.monotonic()
    shares = {team: Counter(where).most_common(1)[0][1] / len(where) for team, where in placed.items()}
    print(
        f"\nprefix: placed {placed} reasons {dict(reasons)} hits {hits:.0f}/{queries:.0f} tokens ({t1 - t0:.1f}s)"
        f"\nround_robin: placed {rr_placed} reasons {dict(rr_reasons)} hits {rr_hits:.0f}/{rr_queries:.0f} tokens"
        f" ({t2 - t1:.1f}s)\nhit ratio prefix/round_robin: {hits / max(rr_hits, 1):.2f}"
    )
    # Each team on one engine (>= 80% of its requests), both engines used.
    assert all(share >= 0.8 for share in shares.values()), placed
    assert {w for where in placed.values() for w in where} == {"engine-0", "engine-1"}, placed
    assert reasons["prefix_hit"] >= len(TEAMS) * (ROUNDS - 1), reasons  # after each team's first request
    # Round robin really did spread each team over both engines (else the comparison proves nothing).
    assert all(set(where) == {"engine-0", "engine-1"} for where in rr_placed.values()), rr_placed
    # The same requests, so the same prompt tokens looked up; prefix routing's hits >= 2x round robin's, and most of
    # each repeated prompt (rounds after the first) came from the cache.
    assert queries == rr_queries > 0, (queries, rr_queries)
    assert hits >= 2 * rr_hits, (hits, rr_hits)
    assert hits >= 0.8 * queries * (ROUNDS - 1) / ROUNDS, (hits, queries)
