"""The fairness benchmark's workload and measures (loadtests/bench_fairness.py): three teams of different shapes sent
open-loop through one gateway pool, and what each got out of it.

Teams (seeded Poisson arrivals, the same schedule for every policy):
- heavy: long prompts and long answers, 5x the interactive team's request rate, standard band;
- interactive: short prompts and answers, in bursts (an agent's parallel tool calls), standard band;
- batch: medium requests in the batch band (priority 2), which runs only when the standard band waits for nothing.

Measures, per team: goodput (requests per second that met the team's TTFT and TPOT SLO, as DistServe and
inference-perf count it), weighted tokens served (prompt + 2 x output, VTC's counter), TTFT p50/p90; between the
two standard-band teams, over the intervals where both had requests waiting in the queue (where a fair share is
defined: a team that waits for nothing has all it asks for), Jain's fairness index of the weighted service each got
and the largest service difference over any such interval (VTC bounds it); the share of requests the
prefix router sent where their prefix is (its hit or its team's home, not spilled for load), and the engines' prefix
cache hit rate (cached / prompt tokens, as the engines reported; 0 from fake engines, which cache nothing).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx
import orjson

W_OUT = 2  # output weight of the weighted-token service (VTC's experiments, the pools' default)


@dataclass(frozen=True)
class Shape:
    """One team's requests: words of prompt (its own fixed system prompt + a varying question), output tokens, arrival
    rate of bursts, requests per burst, band, and its SLO."""

    team: str
    system_words: int
    question_words: int
    output_tokens: int
    bursts_per_s: float
    burst: int
    priority: int
    slo_ttft_s: float
    slo_tpot_s: float


@dataclass
class Sent:
    team: str
    request_id: str
    at: float  # seconds from the run's start
    status: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    end: float | None = None
    queue_s: float = 0.0  # from the gateway's event
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    local: bool = False  # routed where its prefix is (the prefix router's hit or its team's home), not spilled

    def met(self, shape: Shape) -> bool:
        return (
            self.status == 200
            and self.ttft_s is not None
            and self.ttft_s <= shape.slo_ttft_s
            and (self.tpot_s or 0.0) <= shape.slo_tpot_s
        )


def shapes(engine: bool) -> list[Shape]:
    """The three teams: for fake engines (their time is a knob), or sized for SmolLM2 on a 2-core CPU (a word of
    these prompts is ~5 tokens; the heavy prompt ~700 tokens of the engines' 2048)."""
    if engine:
        return [
            Shape("heavy", 110, 30, 64, 2.0, 1, 1, 20.0, 0.5),
            Shape("interactive", 12, 4, 8, 0.1, 4, 1, 2.0, 0.5),
            Shape("batch", 40, 10, 16, 0.1, 1, 2, 120.0, 2.0),
        ]
    return [
        Shape("heavy", 900, 200, 120, 2.5, 1, 1, 10.0, 0.2),
        Shape("interactive", 40, 12, 12, 0.125, 4, 1, 1.0, 0.1),
        Shape("batch", 250, 50, 48, 0.25, 1, 2, 60.0, 1.0),
    ]


def schedule(all_shapes: list[Shape], duration_s: float, seed: int) -> list[tuple[float, Shape, int]]:
    """(send time, shape, question number) for every request, Poisson bursts per team, in time order."""
    rng = random.Random(seed)
    out = []
    for shape in all_shapes:
        t = rng.expovariate(shape.bursts_per_s)
        while t < duration_s:
            out += [(t, shape, rng.randrange(10**6)) for _ in range(shape.burst)]
            t += rng.expovariate(shape.bursts_per_s)
    return sorted(out, key=lambda x: x[0])


def body(shape: Shape, question: int, model: str, fake: dict | None) -> dict:
    system = " ".join(f"{shape.team}-rule-{i % 97}" for i in range(shape.system_words))
    words = " ".join(f"q{question}-{i}" for i in range(shape.question_words))
    out = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": words}],
        "max_tokens": shape.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if fake is not None:  # the fake upstream's service time: the prompt's prefill, then one token per itl
        out["fake"] = fake | {"tokens": shape.output_tokens}
    return out


async def send(client: httpx.AsyncClient, url: str, key: str, payload: dict, sent: Sent, t0: float) -> None:
    headers = {"authorization": f"Bearer {key}", "x-request-id": sent.request_id}
    start = time.perf_counter()
    tokens_at: list[float] = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=payload, headers=headers) as r:
            sent.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    tokens_at.append(time.perf_counter())
    except httpx.HTTPError:
        sent.status = -1
        return
    sent.end = time.perf_counter() - t0
    if tokens_at:
        sent.ttft_s = tokens_at[0] - start
        if len(tokens_at) > 1:
            sent.tpot_s = (tokens_at[-1] - tokens_at[0]) / (len(tokens_at) - 1)


async def run(
    url: str, keys: dict[str, str], plan: list[tuple[float, Shape, int]], model: str, fake: dict | None, tag: str
) -> list[Sent]:
    """Send `plan` open-loop (each request at its time, whatever the others are doing); every request's record."""
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        t0 = time.perf_counter()
        records, tasks = [], []
        for n, (at, shape, question) in enumerate(plan):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            sent = Sent(shape.team, f"{tag}-{shape.team}-{n}", at)
            records.append(sent)
            service = None
            if fake is not None:  # the prompt's prefill time grows with its length, each output token takes itl
                prompt = shape.system_words + shape.question_words
                service = {"ttft_ms": fake["prefill_ms_per_word"] * prompt, "itl_ms": fake["itl_ms"]}
            payload = body(shape, question, model, service)
            tasks.append(asyncio.create_task(send(client, url, keys[shape.team], payload, sent, t0)))
        await asyncio.gather(*tasks)
    return records


def read_events(records: list[Sent], lines: list[bytes]) -> None:
    """Fill each record's queue wait, token counts and prefix routing from the gateway's events."""
    by_id = {r.request_id: r for r in records}
    for line in lines:
        e = orjson.loads(line)
        r = by_id.get(e.get("request_id"))
        if r is None:
            continue
        r.queue_s = (e.get("queue_ms") or 0.0) / 1000
        r.prompt_tokens, r.completion_tokens = e.get("prompt_tokens") or 0, e.get("completion_tokens") or 0
        r.cached_tokens = e.get("cached_tokens") or 0
        r.local = (e.get("route_reason") or {}).get("reason") in ("prefix_hit", "prefix_home")


@dataclass
class Summary:
    policy: str
    duration_s: float
    goodput: dict[str, float] = field(default_factory=dict)  # team -> SLO-meeting requests per second
    served: dict[str, int] = field(default_factory=dict)  # team -> weighted tokens of requests that ended
    ok: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    ttft_p50: dict[str, float] = field(default_factory=dict)
    ttft_p90: dict[str, float] = field(default_factory=dict)
    jain: float = 0.0
    max_gap: float = 0.0  # weighted tokens
    bound: float = 0.0
    hit_rate: float = 0.0
    locality: float = 0.0
    output_tok_s: float = 0.0


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(policy: str, records: list[Sent], all_shapes: list[Shape], duration_s: float, capacity: int) -> Summary:
    s = Summary(policy, duration_s)
    by_shape = {sh.team: sh for sh in all_shapes}
    for team, shape in by_shape.items():
        mine = [r for r in records if r.team == team]
        done = [r for r in mine if r.status == 200]
        s.sent[team], s.ok[team] = len(mine), len(done)
        s.goodput[team] = sum(r.met(shape) for r in mine) / duration_s
        s.served[team] = sum(r.prompt_tokens + W_OUT * r.completion_tokens for r in done)
        ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
        s.ttft_p50[team], s.ttft_p90[team] = _pct(ttfts, 0.5), _pct(ttfts, 0.9)
    prompts = sum(r.prompt_tokens for r in records if r.status == 200)
    s.hit_rate = sum(r.cached_tokens for r in records if r.status == 200) / prompts if prompts else 0.0
    ok = [r for r in records if r.status == 200]
    s.locality = sum(r.local for r in ok) / len(ok) if ok else 0.0
    ends = [r.end for r in records if r.end is not None]
    span = max(ends) if ends else duration_s
    s.output_tok_s = sum(r.completion_tokens for r in records if r.status == 200) / span
    s.max_gap, both = service_gap(records, "heavy", "interactive")
    s.jain = sum(both) ** 2 / (len(both) * sum(x * x for x in both)) if any(both) else 1.0
    done = [r for r in records if r.status == 200 and r.team in ("heavy", "interactive")]
    most = max((r.prompt_tokens + W_OUT * r.completion_tokens for r in done), default=0)
    most_output = max((W_OUT * r.completion_tokens for r in done), default=0)
    s.bound = 2 * most + capacity * most_output  # VTC's 2U, plus the output in flight (charged when it ends)
    return s


def service_gap(records: list[Sent], a: str, b: str) -> tuple[float, list[float]]:
    """The largest |service(a) - service(b)| gained over any interval in which both teams had a request waiting in
    the queue, service counted as the gateway charges it (prompt at dispatch, weighted output at the end); and the
    service each gained while both waited."""
    steps: list[tuple[float, int, float]] = []  # (time, sign, weighted tokens)
    waiting: list[tuple[float, int, str]] = []  # (time, +1 starts / -1 stops waiting, team)
    for r in records:
        if r.status != 200 or r.team not in (a, b) or r.end is None:
            continue
        sign = 1 if r.team == a else -1
        dispatched = r.at + r.queue_s
        steps += [(dispatched, sign, r.prompt_tokens), (r.end, sign, W_OUT * r.completion_tokens)]
        if r.queue_s > 0:
            waiting += [(r.at, 1, r.team), (dispatched, -1, r.team)]
    events = sorted([(t, 0, sign * w, "") for t, sign, w in steps] + [(t, 1, d, team) for t, d, team in waiting])
    count = {a: 0, b: 0}
    diff, worst, low, high = 0.0, 0.0, None, None
    gained = {a: 0.0, b: 0.0}
    for _at, kind, value, team in events:
        if kind == 0:
            if count[a] > 0 and count[b] > 0:
                gained[a if value > 0 else b] += abs(value)
            diff += value
        else:
            count[team] += int(value)
        if count[a] > 0 and count[b] > 0:  # both backlogged: the gap gained since the interval began
            low = diff if low is None else min(low, diff)
            high = diff if high is None else max(high, diff)
            worst = max(worst, high - low)
        else:
            low = high = None
    return worst, [gained[a], gained[b]]
