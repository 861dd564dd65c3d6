"""The rollout policy: windows, p95s, the breach rules and the step / promote / roll back decisions."""

from __future__ import annotations

from tokenweir.policies.canary import (
    PROGRESSING,
    PROMOTED,
    ROLLED_BACK,
    RolloutState,
    Summary,
    Thresholds,
    Window,
    advance,
    breach,
    judged,
    p95,
    restarted,
)

T = Thresholds(window_s=60, min_requests=10, max_error_rate_delta=0.05, max_ttft_p95_ratio=1.5, max_tpot_p95_ratio=2)
STEPS = [10.0, 50.0, 100.0]


def healthy(n: int = 20) -> Summary:
    return Summary(n, 0.0, 0.1, 0.02)


def test_p95_is_the_nearest_rank_and_needs_a_minimum():
    assert p95([float(i) for i in range(1, 101)], 10) == 95.0
    assert p95([3.0, 1.0, 2.0], 3) == 3.0
    assert p95([1.0, 2.0], 3) is None


def test_window_forgets_what_is_older_than_it_and_summarises_the_rest():
    w = Window(10.0)
    for t in range(20):
        w.add(float(t), ok=t % 4 != 0, ttft=0.1 * t, tpot=None)
    s = w.summary(19.0, 3)
    assert s.requests == 11  # t = 9..19
    assert abs(s.error_rate - 2 / 11) < 1e-9  # the failures at t = 12 and 16 (t = 8 and before are gone)
    assert s.ttft_p95 is None and s.tpot_p95 is None  # 11 < MIN_LATENCY_SAMPLES: a p95 of 11 is their max
    w = Window(100.0)
    for t in range(40):
        w.add(float(t), ok=True, ttft=float(t), tpot=None)
    assert w.summary(39.0, 3).ttft_p95 == 37.0  # nearest rank: the 38th of 40


def test_breach_on_errors_latency_or_nothing_below_the_minimum():
    assert breach(Summary(20, 0.2, 0.1, 0.02), healthy(), T).startswith("error rate 20.0%")
    assert breach(Summary(20, 0.04, 0.1, 0.02), healthy(), T) is None  # within the margin
    assert "TTFT p95 300.0 ms" in breach(Summary(20, 0.0, 0.3, 0.02), healthy(), T)
    assert breach(Summary(20, 0.0, 0.149, 0.02), healthy(), T) is None  # under 1.5x
    assert "TPOT p95" in breach(Summary(20, 0.0, 0.1, 0.05), healthy(), T)
    assert breach(Summary(9, 1.0, 9.0, 9.0), healthy(), T) is None  # too few canary requests to judge
    assert breach(Summary(20, 1.0, 9.0, 9.0), healthy(9), T) is None  # too few baseline requests


def test_advance_steps_after_step_s_promotes_past_the_last_and_rolls_back_on_a_breach():
    start = RolloutState(since=100.0)
    assert start.canary_share(STEPS) == 10.0
    assert advance(start, STEPS, 60, 150.0, healthy(), healthy(), T) is None  # the step is not held long enough
    assert advance(start, STEPS, 60, 170.0, healthy(5), healthy(), T) is None  # held, but too few judged
    step1 = advance(start, STEPS, 60, 170.0, healthy(), healthy(), T)
    assert step1 == RolloutState(1, 170.0, PROGRESSING) and step1.canary_share(STEPS) == 50.0
    step2 = advance(step1, STEPS, 60, 240.0, healthy(), healthy(), T)
    assert step2 is not None and step2.canary_share(STEPS) == 100.0
    # at 100% no baseline traffic is left to compare with: held, then promoted
    done = advance(step2, STEPS, 60, 301.0, healthy(), Summary(0, 0.0, None, None), T)
    assert done is not None and done.status == PROMOTED and done.canary_share(STEPS) == 100.0
    assert advance(done, STEPS, 60, 999.0, Summary(20, 1.0, 9, 9), healthy(), T) is None  # final
    back = advance(step1, STEPS, 60, 171.0, Summary(20, 0.5, 0.1, 0.02), healthy(), T)
    assert back is not None and back.status == ROLLED_BACK and back.canary_share(STEPS) == 0.0
    assert "error rate 50.0%" in back.reason
    assert RolloutState.from_dict(back.to_dict()) == back


def test_only_what_the_variants_upstream_did_is_judged_never_a_refusal_or_a_clients_error():
    assert judged("ok", None, 200, served_by_variant=True) is True
    assert judged("ok", None, 200, served_by_variant=False) is False  # a fallback pool (or the baseline) served it
    for status, reason, http in (("error", "upstream_unavailable", 503), ("error", "upstream_broken", 502),
                                 ("error", "upstream_rejected", 500), ("timeout", "ttft_timeout", 504),
                                 # no member of its pool could be asked (circuits open, none, draining)
                                 ("rejected", "upstream_unavailable", 503)):  # fmt: skip
        assert judged(status, reason, http, served_by_variant=True) is False, (status, reason)
    # the upstream refused the client's request (4xx), the gateway refused it (rate, budget, bad input, too long,
    # its queue full or the state away), or the client left: nothing said of the variant
    for status, reason, http in (("error", "upstream_rejected", 400), ("error", "upstream_rejected", 404),
                                 ("rejected", "rate_limited", 429), ("rejected", "too_long", 400),
                                 ("rejected", "queue_full", 503), ("rejected", "state_unavailable", 503),
                                 ("cancelled", "client_disconnected", 499)):  # fmt: skip
        assert judged(status, reason, http, served_by_variant=True) is None, (status, reason)


def test_latency_is_judged_before_any_step_even_with_min_requests_below_the_latency_floor():
    t = Thresholds(60, 5, 0.05, 1.5, 1.5)
    few = Summary(10, 0.0, None, None)  # 10 >= min_requests, but < MIN_LATENCY_SAMPLES: no p95 yet
    start = RolloutState(since=0.0)
    assert advance(start, STEPS, 60, 999.0, few, healthy(), t) is None
    assert advance(start, STEPS, 60, 999.0, healthy(), few, t) is None
    assert advance(start, STEPS, 60, 999.0, healthy(), healthy(), t) == RolloutState(1, 999.0)
    # with 20 latencies the slow canary is judged, and rolled back
    back = advance(start, STEPS, 60, 999.0, Summary(20, 0.0, 1.0, None), healthy(), t)
    assert back is not None and back.status == ROLLED_BACK and back.reason.startswith("TTFT p95 1000.0 ms")
    w = Window(60.0)
    for i in range(19):
        w.add(float(i), ok=True, ttft=1.0, tpot=None)
    assert w.summary(19.0, 5).ttft_p95 is None
    w.add(19.0, ok=True, ttft=1.0, tpot=None)
    assert w.summary(19.0, 5).ttft_p95 == 1.0


def test_a_latency_breach_needs_the_absolute_floor_too():
    t = Thresholds(60, 10, 0.05, 1.5, 1.5, min_ttft_p95_delta_ms=50.0, min_tpot_p95_delta_ms=2.0)
    base = Summary(40, 0.0, 0.0033, 0.001)
    assert breach(Summary(40, 0.0, 0.0060, 0.001), base, t) is None  # 6.0 vs 3.3 ms: noise, not a regression
    assert breach(Summary(40, 0.0, 0.0033, 0.0025), base, t) is None  # TPOT 2.5x, but 1.5 ms
    assert "TTFT p95 60.0 ms" in breach(Summary(40, 0.0, 0.060, 0.001), base, t)
    assert "TPOT p95 4.0 ms" in breach(Summary(40, 0.0, 0.0033, 0.004), base, t)
    assert breach(Summary(40, 0.0, 0.3, 0.001), Summary(40, 0.0, 0.26, 0.001), t) is None  # +40 ms, under 1.5x


def test_a_canary_without_a_healthy_member_is_rolled_back_at_once_once_it_failed():
    start = RolloutState(since=100.0)
    failed = Summary(3, 1.0, None, None)  # fewer than min_requests: no breach by the error rate yet
    assert advance(start, STEPS, 60, 101.0, failed, healthy(), T) is None
    back = advance(start, STEPS, 60, 101.0, failed, healthy(), T, canary_reachable=False)
    assert back is not None and back.status == ROLLED_BACK and "no healthy member" in back.reason
    # nothing failed yet (a pool whose members are still coming up): not judged on that alone
    assert advance(start, STEPS, 60, 101.0, Summary(0, 0.0, None, None), healthy(), T, canary_reachable=False) is None


def test_a_rollout_started_over_is_told_from_a_step_or_a_decision():
    first = RolloutState(since=100.0)
    assert not restarted(None, first)  # first seen: nothing of it was judged before
    assert not restarted(first, first)
    step = RolloutState(1, 200.0)
    assert not restarted(first, step)
    assert restarted(step, RolloutState(since=300.0))  # PUT again mid-rollout
    back = RolloutState(1, 250.0, ROLLED_BACK, "x")
    assert not restarted(step, back)
    assert restarted(back, RolloutState(since=300.0))  # PUT again after a rollback
    assert restarted(first, RolloutState(since=101.0))  # PUT again before the first step
