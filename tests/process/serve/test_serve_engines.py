"""`tokenweir serve --engines 2`, for real: two supervised engine children on SmolLM2 behind one pool. One stack
for the module (its start is most of the cost), route `prefix`, each engine's KV pool bounded (KV_BLOCKS); the
tests run in this order, the one that kills an engine last.

1. Prefix-cache-aware routing, against `round_robin` on a second stack of the same config: the same interleaved
   requests of four teams (distinct ~450-token system prompts, short user turns). With `prefix` each team stays on one
   engine and both engines take teams; the engines' own prefix-cache hit counters (their /metrics, summed, deltas
   over the run) come out at least twice round robin's. Each engine's KV pool holds about two teams' prefixes, not
   four: prefix routing splits the teams' working set between the engines, round robin sends every team to both and
   they evict each other (what the cache-aware route is for). Without that bound both engines would end up holding
   every prefix under round robin, and the gap would only be the warm-up of the second.
2. A poison request: response_formats whose grammars hit the parser's limits part-way get a 400 naming
   `response_format` (one engine tried, never the next), while another team's stream keeps getting tokens, both
   engines stay up (same processes, healthy) and every request has its one event.
3. Four teams, interleaved: each team stays on one engine and both engines take traffic. Then one engine is
   SIGKILLed in the middle of a stream: that stream ends with an `upstream_broken` error naming the instance (one
   event), new requests go to the other engine and succeed, the supervisor restarts the killed one (a warning log
   line, `tokenweir_gateway_engine_restarts_total`), its circuit closes once its /load answers, and it takes traffic
   again.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.support.serve_engines import (
    MODEL,
    TEAMS,
    EnginesStack,
    engine_of,
    engines_stack,
    metric_value,
    system_prompt,
    wait_for,
)
from tests.unit.engine.test_request_failures import POISON_SCHEMAS, response_format
from tokenweir.gateway.accounting.events import read_events

pytestmark = pytest.mark.slow
ROUNDS = 3  # a team's first request and two repeats: the repeats are what either route caches or not
HITS, QUERIES = "tokenweir:prefix_cache_hits_total", "tokenweir:prefix_cache_queries_total"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with engines_stack(tmp_path_factory.mktemp("engines"), "prefix") as stack:
        yield stack


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


def run_workload(stack: EnginesStack, route: str) -> tuple[dict[str, list[str]], float, float, Counter]:
    """The interleaved requests on a fresh stack: team -> engine of each request, the prefix-cache hit and query token
    deltas over the run, and the events' route reasons."""
    urls = stack.engine_urls()
    client = openai.OpenAI(base_url=stack.served.url + "/v1", api_key=stack.served.demo_key, max_retries=0, timeout=120)
    hits0, queries0 = prefix_counters(urls)
    assert queries0 == 0, "a fresh stack: no request has reached its engines yet"
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
        found = {e["request_id"]: e for e in read_events(stack.events_path) if e["request_id"] in rids}
        return found if len(found) == len(rids) else None

    events = wait_for("every request's event", all_events, 15)
    placed: dict[str, list[str]] = {team: [] for team in TEAMS}
    reasons: Counter = Counter()
    for rid, team in rids.items():  # in the order sent
        e = events[rid]
        assert e["status"] == "ok", e
        placed[team].append(engine_of(e))
        reasons[(e.get("route_reason") or {}).get("reason")] += 1
    return placed, hits1 - hits0, queries1 - queries0, reasons


def test_prefix_routing_keeps_teams_on_one_engine_and_doubles_the_engines_cache_hits(stack, tmp_path):
    t0 = time.monotonic()
    placed, hits, queries, reasons = run_workload(stack, "prefix")
    t1 = time.monotonic()
    with engines_stack(tmp_path / "round_robin", "round_robin") as rr_stack:
        rr_placed, rr_hits, rr_queries, rr_reasons = run_workload(rr_stack, "round_robin")
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


def test_poison_grammars_fail_alone_while_another_teams_stream_goes_on(stack):
    served, out, events_path = stack.served, stack.out, stack.events_path
    engines_before = out.engines()
    assert sorted(engines_before) == [0, 1], out.read()
    admin = httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {served.admin_key}"}, timeout=30)
    team = admin.post("/admin/teams", json={"name": "poisoner"}).json()
    poisoner_key = admin.post(f"/admin/teams/{team['id']}/keys", json={"name": "p"}).json()["secret"]
    bystander = openai.OpenAI(base_url=served.url + "/v1", api_key=served.demo_key, max_retries=0, timeout=120)
    poisoner = openai.OpenAI(base_url=served.url + "/v1", api_key=poisoner_key, max_retries=0, timeout=120)

    # Another team's long stream, read on a thread: token arrival times.
    arrivals: list[float] = []
    stream_done = threading.Event()

    def read_stream() -> None:
        stream = bystander.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=160, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.monotonic())
        stream_done.set()

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    wait_for("the bystander's first tokens", lambda: len(arrivals) >= 3, 60)

    refused: list[str] = []
    poison_started = time.monotonic()
    for name, schema in POISON_SCHEMAS.items():
        for seed in range(8):
            rid = f"poison-{name}-{seed}-{uuid.uuid4().hex[:6]}"
            try:
                poisoner.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Write a JSON object."}],
                    response_format=response_format(schema), temperature=1.0, seed=seed, max_tokens=64,
                    stream=seed % 2 == 1, extra_headers={"x-request-id": rid},
                )  # fmt: skip
            except openai.BadRequestError as e:
                error = e.body if isinstance(e.body, dict) and "code" in e.body else e.body.get("error", {})
                assert error["code"] == "invalid_response_format" and error["param"] == "response_format", e.body
                refused.append(rid)
    poison_ended = time.monotonic()
    assert refused, "no poison request was refused"

    # The bystander kept getting tokens while the poison requests ran, and finished.
    assert any(poison_started <= t <= poison_ended for t in arrivals), "the bystander's stream stalled"
    assert stream_done.wait(120) and len(arrivals) >= 150, len(arrivals)

    # Both engines are the same processes, healthy, and serve the next request.
    assert out.engines() == engines_before, out.read()
    for _, url in engines_before.values():
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    again = bystander.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=4, temperature=0
    )
    assert again.choices[0].message.content

    # One event each; a refused poison request tried one engine only, and is billed what the engine counted.
    def refused_events() -> list[dict] | None:
        found = {e["request_id"]: e for e in read_events(events_path)}
        return [found[rid] for rid in refused] if all(rid in found for rid in refused) else None

    for event in wait_for("the poison requests' events", refused_events, 20):
        assert event["status"] == "error" and event["http_status"] == 400, event
        assert len(event["route"]) == 1, event
    assert "Traceback" not in out.read()


def test_serve_two_engines_routes_by_prefix_and_survives_a_killed_engine(stack):
    t_start = time.monotonic()
    served, out, events_path = stack.served, stack.out, stack.events_path
    engines = out.engines()
    assert sorted(engines) == [0, 1], out.read()
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=served.demo_key, max_retries=0, timeout=60)
    events: dict[str, dict] = {}

    def ask(team: str, tag: str, max_tokens: int = 3) -> str:
        rid = f"{tag}-{team}-{uuid.uuid4().hex[:8]}"
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system_prompt(team)}, {"role": "user", "content": "Hi!"}],
            max_tokens=max_tokens,
            temperature=0,
            extra_headers={"x-request-id": rid},
        )
        assert chat.choices[0].message.content is not None
        return rid

    def event(rid: str) -> dict:
        def find():
            for e in read_events(events_path):
                events[e["request_id"]] = e
            return events.get(rid)

        return wait_for(f"the event of {rid}", find, 10)

    # 1. Four teams, two rounds, interleaved: each team's requests on one engine (its prefix is cached there), and
    # both engines used.
    placed: dict[str, list[str]] = {team: [] for team in TEAMS}
    second_round: list[str] = []
    for round_ in range(2):
        for team in TEAMS:
            rid = ask(team, f"r{round_}")
            e = event(rid)
            assert e["status"] == "ok", e
            placed[team].append(engine_of(e))
            if round_ == 1:
                second_round.append(rid)
    for where in placed.values():
        top = Counter(where).most_common(1)[0][1]
        assert top / len(where) >= 0.8, placed
    assert {w for where in placed.values() for w in where} == {"engine-0", "engine-1"}, placed
    second = [event(rid) for rid in second_round]
    assert all((e["cached_tokens"] or 0) >= 256 for e in second), second  # the second round hit the prefix cache

    # 2. SIGKILL the engine under a stream, once the stream is under way.
    victim_team = TEAMS[0]
    victim = placed[victim_team][-1]
    victim_index = int(victim.removeprefix("engine-"))
    other = f"engine-{1 - victim_index}"
    victim_pid = engines[victim_index][0]
    stream_rid = f"kill-{uuid.uuid4().hex[:8]}"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": system_prompt(victim_team)},
            {"role": "user", "content": "Count from one to two hundred, in words."},
        ],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_headers={"x-request-id": stream_rid},
    )
    got = 0
    with pytest.raises(openai.APIError) as broke:
        for _ in stream:
            got += 1
            if got == 3:
                os.kill(victim_pid, signal.SIGKILL)
    assert got >= 3
    assert "broke off" in str(broke.value) and victim in str(broke.value), str(broke.value)
    e = event(stream_rid)
    assert (e["status"], e["reason"], e["http_status"], engine_of(e)) == ("error", "upstream_broken", 502, victim), e
    assert sum(1 for x in read_events(events_path) if x["request_id"] == stream_rid) == 1

    # 3. Meanwhile every team is served by the other engine.
    killed_at = time.monotonic()
    for team in TEAMS:
        e = event(ask(team, "down"))
        assert e["status"] == "ok" and engine_of(e) == other, e

    # 4. The supervisor restarts it: a new pid, a warning, the restart counter; its circuit closes when it answers.
    wait_for("the restart", lambda: out.engines()[victim_index][0] != victim_pid, 15)
    log = out.read()
    assert re.search(rf'"engine_exited".*"upstream": ?"{victim}"|"upstream": ?"{victim}".*"engine_exited"', log), log
    assert '"status": -9' in log or '"status":-9' in log, log
    gw_metrics = httpx.get(served.url + "/metrics", timeout=5).text
    name = "tokenweir_gateway_engine_restarts_total"
    assert metric_value(gw_metrics, name, model=MODEL, upstream=victim) == 1.0, gw_metrics
    assert metric_value(gw_metrics, name, model=MODEL, upstream=other) in (None, 0.0)
    state = "tokenweir_gateway_upstream_circuit_state"

    def closed() -> bool:
        text = httpx.get(served.url + "/metrics", timeout=5).text
        return metric_value(text, state, model=MODEL, upstream=victim) == 0.0

    assert not closed()  # open while it is down
    wait_for("the restarted engine's circuit to close", closed, 120, every_s=0.5)
    back_after = time.monotonic() - killed_at

    # 5. It takes traffic again: a burst the other engine cannot take alone (bounded load) spreads onto it.
    with ThreadPoolExecutor(8) as pool:
        rids = list(pool.map(lambda i: ask(TEAMS[i % 4], "after", max_tokens=8), range(8)))
    after = [event(rid) for rid in rids]
    assert all(e["status"] == "ok" for e in after), after
    assert victim in {engine_of(e) for e in after}, after
    print(f"engine back after {back_after:.1f}s; test body {time.monotonic() - t_start:.1f}s")
