"""The faults of the reliability issue, one function each; every one returns a `FaultResult`.

A result carries the numbers of the table (requests, billed per events / per store, served per upstream, leaks,
5xx and 500s, the follow-up of a max_concurrency-2 team) and `problems`: each way the run broke the contract
(every admitted request billed exactly once, slots and holds always returned, one event per request, no 500,
503 state_unavailable + Retry-After while Redis is down, no team locked out afterwards, ...). The tests assert
`problems == []`; `loadtests/fault_table.py` prints the table.

Every scenario takes `workdir` (a fresh directory) and `before` (write HEAD's config format) and is bounded in
time (a gateway start is ~3-4 s on a slow 2-core machine; the whole set runs in ~2 minutes). Those on Redis also take
`cluster` (a proxied LocalCluster, tests/support/redis_cluster.py): the same fault with a Redis Cluster as the state;
`cluster_failover` is the cluster's own (a primary killed mid-load).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.fault_harness import (
    PROMPT,
    GatewayExited,
    Outcome,
    Req,
    Stack,
    beyond_reservation,
    completion,
    raw_request,
    run,
    storm,
)

PER_REQUEST = len(PROMPT) + 8  # reserved and billed per budget-test request: prompt + max_tokens (tokens = 8)


@dataclass
class FaultResult:
    fault: str
    requests: int = 0  # requests that reached a gateway (connection made), follow-ups included
    billed_events: int = 0  # sum of prompt + completion tokens over the JSONL events
    billed_store: int = 0  # the store's usage rows (after flush / restart)
    served: int = 0  # tokens the upstream served (FakeUpstream counters, or what reached the gateway: see notes)
    events: int = 0
    leaked_slots: int = 0
    leaked_holds: int = 0
    reserved_left: int = 0
    n_5xx: int = 0
    n_500: int = 0
    events_500: int = 0  # events that record an internal error (http_status 500), answered or not
    beyond_reservation: list[str] = field(default_factory=list)  # events served past their reservation, unsaid
    teams_unbalanced: list[str] = field(default_factory=list)  # teams whose store usage != their events' sum
    in_flight_left: int = 0  # requests the gateways still counted in flight or queued after the traffic
    followup: int | None = None  # status of a max_concurrency-2 team's request right after the fault
    statuses: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    skipped: str | None = None

    def add(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            if not o.sent:
                self.statuses["refused"] = self.statuses.get("refused", 0) + 1
                continue
            self.requests += 1
            key = str(o.status) if o.status > 0 else {0: "none", -1: "timeout", -2: "broken"}.get(o.status, "?")
            self.statuses[key] = self.statuses.get(key, 0) + 1
            if o.status >= 500:
                self.n_5xx += 1
            if o.status == 500:
                self.n_500 += 1

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def summary(self) -> str:
        lines = [f"{self.fault}: {len(self.problems)} problem(s)"] + [f"  - {p}" for p in self.problems]
        lines += [f"  statuses {self.statuses}", *[f"  note: {n}" for n in self.notes]]
        return "\n".join(lines)


# --- shared checks ---------------------------------------------------------------------------------------------
def check_outcomes(res: FaultResult, outcomes: list[Outcome], *, allow_unanswered: bool = False) -> None:
    """No 500; every error an OpenAI JSON body; a 503 carries Retry-After; every request got an answer."""
    sent = [o for o in outcomes if o.sent]
    n500 = sum(o.status == 500 for o in sent)
    if n500:
        plain = sum(o.status == 500 and not o.json_error for o in sent)
        res.problem(f"{n500} responses were HTTP 500 ({plain} of them plain text, not an OpenAI error)")
    bad = [o for o in sent if o.status >= 400 and o.status != 500 and o.status != 499 and not o.json_error]
    if bad:
        res.problem(f"{len(bad)} error responses without an OpenAI JSON error body (e.g. {bad[0].body_head[:80]!r})")
    no_ra = [o for o in sent if o.status == 503 and not o.retry_after]
    if any(o.code == "state_unavailable" for o in no_ra):
        res.problem(
            f"{sum(o.code == 'state_unavailable' for o in no_ra)} responses 503 state_unavailable without Retry-After"
        )
    elif no_ra:
        res.notes.append(f"503 without Retry-After: {dict(Counter(o.code for o in no_ra))}")
    if not allow_unanswered:
        lost = [o for o in sent if o.status <= 0]
        if lost:
            res.problem(f"{len(lost)} requests got no HTTP answer (connection broke or timed out)")
    broken = [o for o in sent if o.stream and o.status == 200 and not o.done and not o.sse_error]
    if broken:
        res.problem(f"{len(broken)} streams ended without [DONE] or an SSE error event")


def check_accounting(res: FaultResult, *, served_label: str = "upstream served") -> None:
    if res.events != res.requests:
        res.problem(f"{res.events} events for {res.requests} requests sent (want exactly one each)")
    if res.billed_events != res.served:
        res.problem(f"billed per events {res.billed_events} != {served_label} {res.served}")
    if res.billed_store != res.billed_events:
        res.problem(f"store usage {res.billed_store} != events' sum {res.billed_events}")
    if res.events_500:
        res.problem(f"{res.events_500} events record an internal error (http_status 500)")
    if res.beyond_reservation:
        res.problem(f"{len(res.beyond_reservation)} events served past their reservation: {res.beyond_reservation[:3]}")
    if res.teams_unbalanced and res.billed_store == res.billed_events:
        res.problem(f"store usage != events' sum per team (the totals agree): {res.teams_unbalanced[:3]}")


def check_leaks(res: FaultResult) -> None:
    if res.leaked_slots or res.leaked_holds or res.reserved_left:
        res.problem(
            f"leaked after the fault: {res.leaked_slots} slot leases, {res.leaked_holds} holds, "
            f"{res.reserved_left} tokens still reserved"
        )
    if res.in_flight_left:
        res.problem(f"{res.in_flight_left} requests still in flight or queued in a gateway after the traffic ended")


def check_followup(res: FaultResult) -> None:
    if res.followup is not None and res.followup != 200:
        res.problem(f"follow-up request of a max_concurrency-2 team got {res.followup}, not 200 (locked out)")


def follow_up(res: FaultResult, url: str, small) -> None:
    """Right after the fault, the max_concurrency-2 team must get a 200: nothing of it is still held."""
    res.followup, outcome = followup(url, small.secret)
    res.add([outcome])


def check_contract(res: FaultResult, **accounting) -> None:
    check_accounting(res, **accounting)
    check_leaks(res)
    check_followup(res)


def followup(url: str, secret: str) -> tuple[int, Outcome]:
    """One small request of a team: 200 unless it is locked out (leaked slots) or the gateway is down."""
    out = run(storm(url, [Req(secret, completion(tokens=2), tag="followup")], timeout_s=15))
    return out[0].status, out[0]


def leaks_redis(st: Stack, teams, wait_s: float = 4.0) -> dict:
    """Leases, holds and reserved tokens of `teams` in Redis, polled up to `wait_s` for them to drain to zero
    (a fixed gateway may hand back what Redis missed a little later, once Redis answers again)."""
    deadline = time.monotonic() + wait_s
    while True:
        total = {"slots": 0, "holds": 0, "reserved": 0}
        for t in teams:
            one = st.redis_leaks(t.id)
            for k in total:
                total[k] += one[k]
        if not any(total.values()) or time.monotonic() > deadline:
            return total
        time.sleep(0.2)


def leaks_memory(st: Stack, gw, teams, wait_s: float = 2.0) -> dict:
    deadline = time.monotonic() + wait_s
    while True:
        total = {"slots": 0, "holds": 0, "reserved": 0}
        try:
            for t in teams:
                one = st.memory_leaks(gw, t.id)
                for k in total:
                    total[k] += one[k]
        except (httpx.HTTPError, ValueError) as e:
            return {"slots": -1, "holds": -1, "reserved": -1, "error": str(e)}
        if not any(total.values()) or time.monotonic() > deadline:
            return total
        time.sleep(0.2)


def set_leaks(res: FaultResult, leaks: dict) -> None:
    res.leaked_slots, res.leaked_holds, res.reserved_left = leaks["slots"], leaks["holds"], leaks["reserved"]


def settle_and_stop(st: Stack, res: FaultResult, gateways, seeded: int = 0) -> None:
    """Wait for the events and the usage flush, stop the gateways (SIGTERM: they flush on shutdown), and take
    the final numbers: events, billed per events and per store."""
    st.wait_events(res.requests, timeout=4.0)
    st.wait_store(timeout=3.0, seeded=seeded)
    res.in_flight_left = in_flight_left(st, [gw for gw in gateways if gw.alive()])
    for gw in gateways:
        rc = gw.stop(timeout=20)
        if rc not in (0, 143, -15, None):
            res.notes.append(f"gateway {gw.name} exited with status {rc} on SIGTERM")
    take_events(st, res, seeded)


def in_flight_left(st: Stack, gateways, wait_s: float = 3.0) -> int:
    """What the running gateways still count as in flight or queued, polled up to `wait_s` for it to reach 0."""
    deadline = time.monotonic() + wait_s
    while True:
        left = sum(st.in_flight_left(gw) or 0 for gw in gateways)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def take_events(st: Stack, res: FaultResult, seeded: int = 0) -> None:
    events = st.events()
    res.events = len(events)
    res.events_500 = sum(e.get("http_status") == 500 for e in events)
    res.billed_events = st.events_billed()
    res.billed_store = st.store_billed(seeded)
    res.beyond_reservation = beyond_reservation(events)
    res.teams_unbalanced = [f"{t}: events {b}, store {s}" for t, (b, s) in st.billed_by_team().items() if b != s]


def _spread(n: int, span_s: float) -> list[float]:
    return [span_s * i / max(1, n - 1) for i in range(n)]


def _cut_during(proxy, at_s: float, for_s: float, mode: str = "refuse", rst: bool = True):
    async def during(t0: float) -> None:
        await asyncio.sleep(max(0.0, at_s - (time.monotonic() - t0)))
        await asyncio.to_thread(proxy.cut, mode, rst)
        await asyncio.sleep(for_s)
        await asyncio.to_thread(proxy.restore)

    return during


def _limits(**kw):
    from tokenweir.policies.limits import TeamLimits

    return TeamLimits(**kw)


def _scenario(fn):
    """Time it, and turn a gateway that died into a result (not an exception)."""

    def wrapper(workdir: Path, before: bool = False, **kw) -> FaultResult:
        t0 = time.monotonic()
        res = FaultResult(fault=kw.pop("name", fn.__name__))
        try:
            fn(Path(workdir), before, res, **kw)
        except GatewayExited as e:
            res.problem(f"gateway exited with status {e.rc}: {e.log.strip().splitlines()[-1:]}")
        if kw.get("cluster") is not None:
            res.fault += " [redis cluster]"
        res.wall_s = round(time.monotonic() - t0, 1)
        return res

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


# --- (a) Redis cut ~2 s mid-load -------------------------------------------------------------------------------
@_scenario
def redis_cut(
    workdir: Path,
    before: bool,
    res: FaultResult,
    n: int = 60,
    cut_at_s: float = 0.8,
    cut_s: float = 2.0,
    rst: bool = True,
    cluster=None,
):
    """60 requests (half streams) spread over 2.4 s; Redis connections are reset at 0.8 s (closed with a FIN
    when rst=False) and new ones refused until 2.8 s."""
    res.fault = "redis cut 2s mid-load" + ("" if rst else " (FIN)")
    with Stack(workdir, before=before, cluster=cluster) as st:
        big, small = st.team("big"), st.team("small", _limits(max_concurrency=2))
        gw = st.gateway("a").start()
        reqs = []
        for i, delay in enumerate(_spread(n, 2.4)):
            team = small if i % 5 == 4 else big
            if i % 2:
                body = completion(stream=True, tokens=10, ttft_ms=200, itl_ms=60)
            else:
                body = completion(tokens=10, ttft_ms=700)
            reqs.append(Req(team.secret, body, delay_s=delay))
        during = _cut_during(st.redis_proxy, cut_at_s, cut_s, rst=rst)
        outcomes = run(storm(gw.url, reqs, timeout_s=20, during=during))
        res.add(outcomes)
        check_outcomes(res, outcomes)
        down = [o for o in outcomes if o.status == 503]
        if down and not all(o.code == "state_unavailable" for o in down):
            res.notes.append(f"503 codes: {Counter(o.code for o in down)}")
        st.wait_events(res.requests, timeout=4.0)
        set_leaks(res, leaks_redis(st, [big, small]))
        follow_up(res, gw.url, small)
        set_leaks(res, leaks_redis(st, [big, small], wait_s=0.5))
        settle_and_stop(st, res, [gw])
        res.served = st.served()
        check_contract(res)


def redis_cut_fin(workdir: Path, before: bool = False, **kw) -> FaultResult:
    """(a) with Redis's connections closed cleanly (FIN, as a Redis that exits closes them) instead of reset."""
    return redis_cut(workdir, before, rst=False, **kw)


# --- (b) Redis pool exhaustion ---------------------------------------------------------------------------------
@_scenario
def redis_pool_exhaustion(
    workdir: Path,
    before: bool,
    res: FaultResult,
    n: int = 400,
    max_connections: int = 20,
    finish_at_s: float = 2.5,
    cluster=None,
):
    """`n` overlapping requests against a small Redis pool (HEAD: redis-py's default of 100, which raises
    MaxConnectionsError when full): 40% arrive at once, the rest over 1.5 s, and every one is timed (its ttft) to
    finish at `finish_at_s`, so admission and settlement both stampede the pool."""
    res.fault = f"redis pool exhaustion ({n} overlapping)"
    with Stack(workdir, before=before, cluster=cluster) as st:
        big, small = st.team("big"), st.team("small", _limits(max_concurrency=2))
        gw = st.gateway(
            "a",
            capacity=1024,
            state_opts={"max_connections": max_connections, "pool_timeout_s": 10.0, "timeout_s": 2.0},
        ).start()
        burst = int(n * 0.4)
        delays = [0.0] * burst + _spread(n - burst, 1.5)
        reqs = []
        for i, delay in enumerate(delays):
            team = small if i % 20 == 7 else big
            ttft = int((finish_at_s - delay) * 1000)
            body = completion(stream=i % 4 == 3, tokens=4, ttft_ms=ttft, itl_ms=5)
            reqs.append(Req(team.secret, body, delay_s=delay))
        outcomes = run(storm(gw.url, reqs, timeout_s=40))
        res.add(outcomes)
        check_outcomes(res, outcomes)
        st.wait_events(res.requests, timeout=5.0)
        set_leaks(res, leaks_redis(st, [big, small]))
        follow_up(res, gw.url, small)
        set_leaks(res, leaks_redis(st, [big, small], wait_s=0.5))
        settle_and_stop(st, res, [gw])
        res.served = st.served()
        check_contract(res)
        if not before:
            res.notes.append(f"state.max_connections={max_connections}")


# --- (c) Redis down at start, then restored; then down while serving --------------------------------------------
@_scenario
def redis_down(workdir: Path, before: bool, res: FaultResult, cluster=None):
    """Redis refuses connections before the gateway starts (the store already holds spend): start-up must wait
    and retry, not exit; once Redis is back it serves. Then Redis goes down while serving: 503
    state_unavailable + Retry-After, /health 503 naming the state backend, /livez 200; back to 200 after."""
    res.fault = "redis down (at start, then while serving)"
    with Stack(workdir, before=before, cluster=cluster) as st:
        big = st.team("big", _limits(tokens_per_day=10_000_000))
        small = st.team("small", _limits(max_concurrency=2))
        seeded = 100
        st.seed_spend(big, seeded)
        proxy = st.redis_proxy
        proxy.cut()
        gw = st.gateway("a")
        gw.start(wait=False)
        outcomes: list[Outcome] = []
        # --- phase 1: down at start
        exited = None
        deadline = time.monotonic() + 6.0  # HEAD exits (status 3) ~1 s after its imports, ~3-4 s here
        live_seen = False
        while time.monotonic() < deadline:
            if not gw.alive():
                exited = gw.proc.returncode
                break
            if gw.liveness(0.5) == 200:  # listening while Redis is down: give it a moment to try Redis
                live_seen = True
                time.sleep(1.0)
                break
            time.sleep(0.2)
        if exited is not None:
            res.problem(f"start-up with Redis down exited with status {exited} instead of waiting")
        else:
            h_status, _ = gw.probe("/health")
            if h_status == 200:
                res.problem("/health said 200 while Redis was down at start-up")
            if live_seen:
                early = run(storm(gw.url, [Req(big.secret, completion(tokens=4)) for _ in range(3)], timeout_s=15))
                outcomes += early
                _check_down(res, early, "at start-up")
            res.notes.append(f"at start-up with Redis down: listening={live_seen}, /health {h_status}")
        proxy.restore()
        if exited is not None:
            gw.start(wait=False)  # HEAD: start it again now that Redis answers
        try:
            gw.wait_ready(timeout=20)
        except TimeoutError:
            res.problem("not ready 20 s after Redis came back")
        after = run(storm(gw.url, [Req(big.secret, completion(tokens=4)) for _ in range(4)], timeout_s=15))
        outcomes += after
        if not all(o.status == 200 for o in after):
            res.problem(f"after Redis came back: {Counter(o.status for o in after)} (want all 200)")
        # --- phase 2: down while serving
        proxy.cut()
        time.sleep(0.3)
        h_status, h_body = gw.probe("/health", timeout=5)
        l_status, _ = gw.probe("/livez", timeout=5)
        down = run(storm(gw.url, [Req(big.secret, completion(tokens=4)) for _ in range(5)], timeout_s=20))
        outcomes += down
        _check_down(res, down, "while serving")
        checks = h_body.get("checks") if isinstance(h_body, dict) else None
        if h_status != 503 or not isinstance(checks, dict) or checks.get("state") in (None, "ok", "up"):
            res.problem(f"/health with Redis down: {h_status} {str(h_body)[:120]} (want 503 naming the state)")
        if l_status != 200:
            res.problem(f"/livez with Redis down: {l_status} (want 200)")
        res.notes.append(f"Redis down while serving: /health {h_status}, /livez {l_status}")
        proxy.restore()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and gw.probe("/health")[0] != 200:
            time.sleep(0.2)
        back = run(storm(gw.url, [Req(big.secret, completion(tokens=4)) for _ in range(3)], timeout_s=15))
        outcomes += back
        if not all(o.status == 200 for o in back):
            res.problem(f"after Redis came back (2): {Counter(o.status for o in back)} (want all 200)")
        res.add(outcomes)
        check_outcomes(res, outcomes)
        st.wait_events(res.requests, timeout=4.0)
        set_leaks(res, leaks_redis(st, [big, small]))
        follow_up(res, gw.url, small)
        settle_and_stop(st, res, [gw], seeded=seeded)
        res.served = st.served()
        check_contract(res)


def _check_down(res: FaultResult, outcomes: list[Outcome], when: str) -> None:
    sent = [o for o in outcomes if o.sent]
    good = [o for o in sent if o.status == 503 and o.code == "state_unavailable" and o.retry_after]
    if len(good) != len(sent):
        got = Counter((o.status, o.code) for o in sent)
        res.problem(f"Redis down {when}: {dict(got)} (want 503 state_unavailable + Retry-After)")


# --- (c') fail_open -------------------------------------------------------------------------------------------
@_scenario
def redis_down_fail_open(workdir: Path, before: bool, res: FaultResult, n: int = 12, cluster=None):
    """`state: {on_unavailable: fail_open}`: with Redis down, requests are admitted under local limits (200),
    and billed once Redis is back."""
    res.fault = "redis down, fail_open"
    if before:
        res.skipped = "HEAD has no state.on_unavailable switch"
        return
    with Stack(workdir, before=before, cluster=cluster) as st:
        big, small = st.team("big"), st.team("small", _limits(max_concurrency=2))
        gw = st.gateway("a", state_opts={"on_unavailable": "fail_open"}).start()
        st.redis_proxy.cut()
        time.sleep(0.3)
        outcomes = run(storm(gw.url, [Req(big.secret, completion(tokens=6, ttft_ms=50)) for _ in range(n)]))
        st.redis_proxy.restore()
        res.add(outcomes)
        check_outcomes(res, outcomes)
        if not all(o.status == 200 for o in outcomes):
            res.problem(f"fail_open with Redis down: {Counter(o.status for o in outcomes)} (want all 200)")
        time.sleep(1.0)
        st.wait_events(res.requests, timeout=4.0)
        follow_up(res, gw.url, small)
        set_leaks(res, leaks_redis(st, [big, small]))
        settle_and_stop(st, res, [gw])
        res.served = st.served()
        check_contract(res)


# --- (d) SIGKILL after a burst --------------------------------------------------------------------------------
@_scenario
def sigkill_after_burst(workdir: Path, before: bool, res: FaultResult, n_fit: int = 12):
    """In-memory state, SQLite, a day budget that admits `n_fit` requests. A burst spends it all, SIGKILL 0.3 s
    later (usage flushes every 2 s), restart: the store's spend must equal the events' sum, and a second burst
    must find the budget spent (not spend it twice)."""
    res.fault = "SIGKILL 0.3s after a burst"
    budget = PER_REQUEST * n_fit + PER_REQUEST // 2
    with Stack(workdir, before=before, redis_proxy=False) as st:
        team = st.team("budget", _limits(tokens_per_day=budget))
        small = st.team("small", _limits(max_concurrency=2))
        gw = st.gateway("a", state="memory", usage_flush_s=2.0, events_flush_s=0.1).start()
        first = run(storm(gw.url, [Req(team.secret, completion(tokens=8)) for _ in range(n_fit + 4)]))
        time.sleep(0.3)
        gw.kill()
        events_at_kill = st.events_billed()
        gw.start()
        stored = st.wait_store(timeout=3.0)
        if stored != events_at_kill:
            res.problem(f"after SIGKILL + restart the store holds {stored} tokens, the events {events_at_kill}")
        res.notes.append(f"store after restart {stored} vs events {events_at_kill}")
        second = run(storm(gw.url, [Req(team.secret, completion(tokens=8)) for _ in range(n_fit)]))
        admitted = sum(o.status == 200 for o in first + second)
        if admitted > n_fit:
            res.problem(f"the day budget (fits {n_fit}) admitted {admitted} across the restart (spent twice)")
        res.notes.append(f"admitted {admitted} (budget fits {n_fit})")
        outcomes = first + second
        res.add(outcomes)
        check_outcomes(res, outcomes)
        st.wait_events(res.requests, timeout=4.0)
        set_leaks(res, leaks_memory(st, gw, [team, small]))
        follow_up(res, gw.url, small)
        settle_and_stop(st, res, [gw])
        res.served = st.served()
        check_contract(res)


# --- (e) SIGTERM past the grace period -------------------------------------------------------------------------
@_scenario
def sigterm_past_grace(workdir: Path, before: bool, res: FaultResult, grace_s: float = 1.0, cluster=None):
    """Streams of ~4 s and non-streams waiting ~4 s for their first token; SIGTERM at 1 s with a 1 s grace.
    Clients must get an OpenAI error (503 shutting_down JSON, or an SSE error event), never a plain-text 500;
    every request has its one event; billed == served; no slot of the max_concurrency-2 team survives."""
    res.fault = f"SIGTERM past grace ({grace_s:g}s)"
    with Stack(workdir, before=before, cluster=cluster) as st:
        big, small = st.team("big"), st.team("small", _limits(max_concurrency=2))
        gw = st.gateway("a", shutdown_grace_s=grace_s).start()
        reqs = [Req(big.secret, completion(stream=True, tokens=40, ttft_ms=100, itl_ms=100)) for _ in range(8)]
        reqs += [Req(big.secret, completion(tokens=8, ttft_ms=4000)) for _ in range(4)]
        reqs += [Req(small.secret, completion(tokens=8, ttft_ms=4000)) for _ in range(2)]

        async def during(t0: float) -> None:
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
            gw.signal(15)

        outcomes = run(storm(gw.url, reqs, timeout_s=20, during=during))
        rc = gw.wait_exit(20)
        res.notes.append(f"exit status {rc}")
        res.add(outcomes)
        check_outcomes(res, outcomes)
        cut = [o for o in outcomes if not o.stream]
        bad = [o for o in cut if not (o.status == 503 and o.json_error and o.code == "shutting_down")]
        if bad:
            got = Counter((o.status, o.code or ("plain text" if not o.json_error else None)) for o in bad)
            res.problem(f"non-stream requests cut at shutdown got {dict(got)} (want 503 shutting_down JSON)")
        streams = [o for o in outcomes if o.stream and o.status == 200]
        bad_s = [o for o in streams if not o.done and o.sse_error != "shutting_down"]
        if bad_s:
            res.problem(f"{len(bad_s)} streams cut at shutdown without an SSE shutting_down error")
        take_events(st, res)
        # restart (what the shutdown could not hand back may be handed back by the next start): the team must
        # not be locked out by leases left behind
        gw.start()
        set_leaks(res, leaks_redis(st, [big, small]))
        follow_up(res, gw.url, small)
        settle_and_stop(st, res, [gw])
        res.served = st.served()
        check_contract(res)


# --- (f) upstream dies mid-stream ------------------------------------------------------------------------------
@_scenario
def upstream_dies(workdir: Path, before: bool, res: FaultResult, cluster=None):
    """(1) streams the upstream breaks after 4 chunks (`fail_after`); (2) the upstream killed mid-stream (the
    TCP link to it cut: connections reset, new ones refused; back 1 s later). Billed == served: in (1) the
    upstream's own counters; in (2) what reached the gateway (the upstream's counters there also count tokens
    it wrote into the dead connection). No leaks, no 500."""
    res.fault = "upstream dies mid-stream"
    with Stack(workdir, before=before, upstream_proxy=True, cluster=cluster) as st:
        big, small = st.team("big"), st.team("small", _limits(max_concurrency=2))
        gw = st.gateway("a", breaker_failures=1000).start()  # keep routing to it: this is about billing
        # (1) fail_after
        reqs = [Req(big.secret, completion(stream=True, tokens=20, itl_ms=20, fail_after=4)) for _ in range(6)]
        reqs += [Req(small.secret, completion(stream=True, tokens=20, itl_ms=20, fail_after=4)) for _ in range(2)]
        reqs += [Req(big.secret, completion(tokens=6)) for _ in range(4)]
        first = run(storm(gw.url, reqs, timeout_s=15))
        st.wait_events(sum(o.sent for o in first), timeout=4.0)
        served_1 = st.served()
        # (2) the upstream dies mid-stream
        reqs = [Req(big.secret, completion(stream=True, tokens=60, itl_ms=50, ttft_ms=50)) for _ in range(6)]
        reqs += [Req(small.secret, completion(stream=True, tokens=60, itl_ms=50, ttft_ms=50)) for _ in range(2)]
        reqs += [Req(big.secret, completion(tokens=6, ttft_ms=2000)) for _ in range(3)]
        second = run(storm(gw.url, reqs, timeout_s=15, during=_cut_during(st.upstream_proxy, 1.0, 1.0)))
        delivered_2 = sum(len(PROMPT) + o.tokens for o in second if o.status == 200 and (o.tokens or not o.stream))
        fake_2 = st.served() - served_1
        outcomes = first + second
        res.add(outcomes)
        check_outcomes(res, outcomes)
        broken = [o for o in second if o.stream and o.status == 200 and o.sse_error]
        res.notes.append(
            f"killed phase: {len(broken)} streams ended by an SSE error; upstream counted {fake_2}, "
            f"the gateway received {delivered_2}"
        )
        st.wait_events(res.requests, timeout=4.0)
        set_leaks(res, leaks_redis(st, [big, small]))
        known = set(st.fake.records)
        follow_up(res, gw.url, small)
        settle_and_stop(st, res, [gw])
        res.served = served_1 + delivered_2 + st.served_by(set(st.fake.records) - known)
        check_contract(res, served_label="served (upstream counters; what reached the gateway once it died)")


# --- (g) clients leaving at every point ------------------------------------------------------------------------
@_scenario
def clients_leave(workdir: Path, before: bool, res: FaultResult, sweep: int = 30, cluster=None):
    """Pool capacity 1. Clients leave halfway through the body, right after sending it, while queued, while a
    non-stream request is being generated, mid-stream, a sweep of instants a few ms after the body, and while
    admission waits for a slow Redis's answer to its reserve or its slot. Every request has one event (none an
    internal error), billed == served (aborts report what was made), nothing leaked (the max_concurrency-2 team
    leaves some too, so a leaked lease locks it out)."""
    res.fault = "clients leave (mid-body / after body / queued / mid-stream / slow Redis)"
    with Stack(workdir, before=before, cluster=cluster) as st:
        big, small = st.team("big"), st.team("small", _limits(max_concurrency=2))
        gw = st.gateway("a", capacity=1).start()
        url, proxy = gw.url, st.redis_proxy

        async def scenario() -> list[Outcome]:
            blocker_req = Req(big.secret, completion(stream=True, tokens=25, itl_ms=60), tag="blocker")
            blocker = asyncio.ensure_future(storm(url, [blocker_req], timeout_s=15))
            await asyncio.sleep(0.3)
            first = [raw_request(url, big.secret, completion(tokens=4), leave_after_s=0.4) for _ in range(3)]
            first += [raw_request(url, small.secret, completion(tokens=4), leave_after_s=0.4)]
            first += [raw_request(url, big.secret, completion(tokens=4), leave_after_s=0) for _ in range(3)]
            # leaving a few ms after the body: sweeps the instants where admission awaits Redis (reserve, slot)
            first += [
                raw_request(url, big.secret, completion(tokens=4), leave_after_s=0.001 + 0.0015 * i)
                for i in range(sweep)
            ]
            first += [raw_request(url, small.secret, completion(tokens=4), leave_after_s=0)]
            first += [raw_request(url, big.secret, completion(tokens=4), partial_body=True)]
            outs = list(await asyncio.gather(*first))
            outs += await blocker
            later = [
                raw_request(url, big.secret, completion(stream=True, tokens=40, itl_ms=40), leave_after_events=4)
                for _ in range(3)
            ]
            later += [
                raw_request(url, small.secret, completion(stream=True, tokens=40, itl_ms=40), leave_after_events=4)
            ]
            later += [raw_request(url, big.secret, completion(tokens=8, ttft_ms=1500), leave_after_s=0.3)]
            later += [raw_request(url, small.secret, completion(tokens=8, ttft_ms=1500), leave_after_s=0.3)]
            outs += await asyncio.gather(*later)
            # Redis answers 0.3 s late: leave while admission waits for the reserve's answer (0.15 s), then for
            # the slot's (0.45 s); the scripts ran in Redis, so what they took must be given back
            proxy.latency_s = 0.3
            slow = [raw_request(url, big.secret, completion(tokens=4), leave_after_s=0.15) for _ in range(2)]
            slow += [raw_request(url, big.secret, completion(tokens=4), leave_after_s=0.45)]
            slow += [raw_request(url, small.secret, completion(tokens=4), leave_after_s=0.45) for _ in range(2)]
            outs += await asyncio.gather(*slow)
            await asyncio.sleep(0.4)
            proxy.latency_s = 0.0
            return outs

        outcomes = run(scenario())
        # raw leavers never read a status: count them as sent, judged by their events, not their answers
        res.add(outcomes)
        check_outcomes(res, [o for o in outcomes if o.tag != "raw"])
        st.wait_events(res.requests, timeout=5.0)
        set_leaks(res, leaks_redis(st, [big, small]))
        follow_up(res, url, small)
        settle_and_stop(st, res, [gw])
        res.served = st.served()
        reasons = Counter(e.get("reason") for e in st.events())
        res.notes.append(f"event reasons {dict(reasons)}")
        check_contract(res)
        # statuses of raw leavers are mostly "none" (they left before an answer): not 5xx
        res.statuses.pop("none", None)


# --- (h) two replicas on one Redis under (a) and (b) -----------------------------------------------------------
@_scenario
def two_replicas(workdir: Path, before: bool, res: FaultResult, n_fit: int = 30, storm_n: int = 300, cluster=None):
    """Two gateway processes on one Redis (through the proxy), one store. (a) 80 requests alternating between
    them with a 2 s Redis cut; (b) `storm_n` at once. Each storm's team has a day budget that fits `n_fit`
    requests: the two together must not admit more (no 2x overspend), and bill exactly what was served."""
    res.fault = "two replicas: redis cut + pool exhaustion"
    budget = PER_REQUEST * n_fit + PER_REQUEST // 2
    with Stack(workdir, before=before, cluster=cluster) as st:
        team_a = st.team("cut", _limits(tokens_per_day=budget))
        team_b = st.team("storm", _limits(tokens_per_day=budget))
        small = st.team("small", _limits(max_concurrency=2))
        opts = {"max_connections": 20, "pool_timeout_s": 10.0, "timeout_s": 2.0}
        gws = [st.gateway(name, capacity=1024, state_opts=opts) for name in ("r1", "r2")]
        for gw in gws:
            gw.start(wait=False)
        for gw in gws:
            gw.wait_ready(40)
        # (a) Redis cut
        reqs = [
            Req(team_a.secret, completion(tokens=8, ttft_ms=300, stream=i % 2 == 1), url=gws[i % 2].url, delay_s=d)
            for i, d in enumerate(_spread(80, 2.4))
        ]
        out_a = run(storm(gws[0].url, reqs, timeout_s=20, during=_cut_during(st.redis_proxy, 0.8, 2.0)))
        # (b) pool exhaustion on both
        reqs = [
            Req(team_b.secret, completion(tokens=8, ttft_ms=200, stream=i % 4 == 3), url=gws[i % 2].url)
            for i in range(storm_n)
        ]
        out_b = run(storm(gws[0].url, reqs, timeout_s=40))
        for label, outs in (("cut", out_a), ("storm", out_b)):
            admitted = sum(o.status == 200 for o in outs)
            res.notes.append(f"{label}: admitted {admitted} (budget fits {n_fit}), {Counter(o.status for o in outs)}")
            if admitted > n_fit:
                res.problem(f"{label}: two replicas admitted {admitted}, the day budget fits {n_fit}")
        outcomes = out_a + out_b
        res.add(outcomes)
        check_outcomes(res, outcomes)
        st.wait_events(res.requests, timeout=5.0)
        set_leaks(res, leaks_redis(st, [team_a, team_b, small]))
        follow_up(res, gws[1].url, small)
        settle_and_stop(st, res, gws)
        for team in (team_a, team_b):
            billed = sum(e["prompt_tokens"] + e["completion_tokens"] for e in st.events() if e.get("team") == team.id)
            if billed > budget:
                res.problem(f"team {team.name} billed {billed} tokens, its day budget is {budget}")
        res.served = st.served()
        check_contract(res)


# --- (i) Redis Cluster: a primary killed mid-load, its replica promoted --------------------------------------------
@_scenario
def cluster_failover(
    workdir: Path,
    before: bool,
    res: FaultResult,
    cluster=None,
    n: int = 80,
    span_s: float = 4.0,
    kill_at_s: float = 1.0,
    lease_s: float = 2.0,
    hold_s: float = 4.0,
):
    """A Redis Cluster as the state (3 primaries, 3 replicas, cluster-node-timeout 1 s), one gateway with short
    leases (`lease_s`, `hold_s`). `n` requests (half streams) over `span_s`; at `kill_at_s` the primary that serves
    the busiest team is killed (SIGKILL) and its replica promoted ~2 s later. While the cluster is down requests get
    503 state_unavailable with Retry-After (never a 500); once the replica serves, the gateway finds it (a call that
    failed has the slot map read again: one request at a time until one is served) and every request is served again.
    Billing exact, one event per request; whatever a lost answer may have left in Redis is gone once the leases and
    holds have expired (the next request of each team reaps what expired)."""
    res.fault = "redis cluster: a primary killed mid-load, failover"
    if before or cluster is None:
        res.skipped = "needs a Redis Cluster (and state.cluster)"
        return
    from tests.support.redis_cluster import slot_of

    with Stack(workdir, before=before, cluster=cluster) as st:
        big, small, other = st.team("big"), st.team("small", _limits(max_concurrency=2)), st.team("other")
        gw = st.gateway("a", state_opts={"lease_s": lease_s, "hold_s": hold_s}).start()
        slot = slot_of(big.id)  # the `{team}` hash tag: the slot of its id
        victim = cluster.primary_of(slot)
        reqs = []
        for i, delay in enumerate(_spread(n, span_s)):
            team = small if i % 5 == 4 else other if i % 5 == 3 else big
            body = completion(stream=i % 2 == 1, tokens=8, ttft_ms=100, itl_ms=20)
            reqs.append(Req(team.secret, body, delay_s=delay))
        took_s: list[float] = []

        async def during(t0: float) -> None:
            await asyncio.sleep(max(0.0, kill_at_s - (time.monotonic() - t0)))
            await asyncio.to_thread(cluster.kill, victim)
            await asyncio.to_thread(cluster.wait_failover, slot, victim)
            took_s.append(time.monotonic() - t0 - kill_at_s)

        try:
            outcomes = run(storm(gw.url, reqs, timeout_s=30, during=during))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the first requests after it may still find the old map
                probe = run(storm(gw.url, [Req(big.secret, completion(tokens=4))], timeout_s=15))
                outcomes += probe
                if probe[0].status == 200:
                    break
                time.sleep(0.1)
            after = run(storm(gw.url, [Req(big.secret, completion(tokens=4)) for _ in range(8)], timeout_s=15))
        finally:
            if not victim.alive():
                cluster.restart(victim)  # back as a replica: the cluster whole for what comes next
        res.notes.append(f"failover took {took_s[0]:.1f} s" if took_s else "no failover seen")
        outcomes += after
        res.add(outcomes)
        check_outcomes(res, outcomes)
        down = [o for o in outcomes if o.status == 503]
        if not down or any(o.code != "state_unavailable" for o in down):
            res.problem(f"while the cluster failed over: {Counter((o.status, o.code) for o in down)} (want some 503 "
                        "state_unavailable, nothing else)")  # fmt: skip
        if not all(o.status == 200 for o in after):
            bad = next(o for o in after if o.status != 200)
            res.problem(f"after the failover: {Counter(o.status for o in after)} (want all 200; {bad.body_head[:160]})")
        st.wait_events(res.requests, timeout=5.0)
        teams = [big, small, other]
        left = leaks_redis(st, teams, wait_s=8.0)  # what failed to settle is replayed from the outbox (backoff <= 5 s)
        if any(left.values()):
            # an answer lost with the primary (a settle it took but never passed on) leaves a hold or a lease that
            # only its expiry ends: past it, each team's next request reaps them
            res.notes.append(f"left before their expiry: {left}")
            time.sleep(max(lease_s, hold_s) + 1.0)
            for team in teams:
                follow_up(res, gw.url, team)
            left = leaks_redis(st, teams, wait_s=2.0)
        set_leaks(res, left)
        follow_up(res, gw.url, small)
        settle_and_stop(st, res, [gw])
        res.served = st.served()
        check_contract(res)


SCENARIOS = [
    redis_cut,
    redis_cut_fin,
    redis_pool_exhaustion,
    redis_down,
    redis_down_fail_open,
    sigkill_after_burst,
    sigterm_past_grace,
    upstream_dies,
    clients_leave,
    two_replicas,
]
