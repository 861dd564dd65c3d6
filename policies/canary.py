"""Canary rollouts: where a rollout stands, the canary's share it gives, and the verdict on its indicators.

A rollout steps a canary variant's share of the subjects up a list of percentages. At each step the canary and
the baseline are compared over a sliding window (with a minimum sample of each): an error rate above the
baseline's by more than a margin, or a TTFT p95 or TPOT p95 above the baseline's by more than a ratio and by more
than an absolute floor (a few ms of scheduling noise between two fast upstreams is no regression), is a breach
(rolled back: share 0), and so is a canary left with no healthy member once it has failed a request. A step held
long enough with no breach moves to the next only once latency was judged too (each window holds
MIN_LATENCY_SAMPLES latencies, whatever `min_requests` says); past the last, promoted (100%).
Pure: the windows are filled and the state stored by gateway/runtime/rollouts.py.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

PROGRESSING, PROMOTED, ROLLED_BACK = "progressing", "promoted", "rolled_back"
# A p95 of fewer values is their maximum: one slow request would decide. Latency is judged on at least this many,
# and no step is taken before it was.
MIN_LATENCY_SAMPLES = 20
# The gateway's reason for a request no member of its variant's pool could be asked to serve (every circuit open,
# none, all draining): the variant's failure, though its upstream never saw the request.
UNDELIVERED_REASONS = frozenset({"upstream_unavailable"})


@dataclass(frozen=True, slots=True)
class RolloutState:
    step: int = 0  # index into the rollout's steps
    since: float = 0.0  # wall time the step began (a replica's clock: steps are minutes, clocks agree to ms)
    status: str = PROGRESSING
    reason: str | None = None  # why it was rolled back or promoted

    def canary_share(self, steps: list[float]) -> float:
        """The canary's share in percent."""
        if self.status == ROLLED_BACK:
            return 0.0
        if self.status == PROMOTED:
            return 100.0
        return steps[min(self.step, len(steps) - 1)]

    def to_dict(self) -> dict[str, object]:
        return {"step": self.step, "since": self.since, "status": self.status, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> RolloutState:
        status = data.get("status", PROGRESSING)
        assert status in (PROGRESSING, PROMOTED, ROLLED_BACK), status
        step, since, reason = data.get("step", 0), data.get("since", 0.0), data.get("reason")
        assert isinstance(step, int) and isinstance(since, int | float) and (reason is None or isinstance(reason, str))
        return cls(step, float(since), str(status), reason)


@dataclass(frozen=True, slots=True)
class Thresholds:
    window_s: float
    min_requests: int
    max_error_rate_delta: float
    max_ttft_p95_ratio: float
    max_tpot_p95_ratio: float
    min_ttft_p95_delta_ms: float = 0.0  # a latency breach is also this far above the baseline's p95
    min_tpot_p95_delta_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Summary:
    """One variant's window: requests judged, the share of them that failed, and latency p95s (None: too few)."""

    requests: int
    error_rate: float
    ttft_p95: float | None
    tpot_p95: float | None

    def to_dict(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "error_rate": round(self.error_rate, 4),
            "ttft_p95_ms": None if self.ttft_p95 is None else round(self.ttft_p95 * 1000, 1),
            "tpot_p95_ms": None if self.tpot_p95 is None else round(self.tpot_p95 * 1000, 2),
        }


@dataclass(slots=True)
class Window:
    """A variant's outcomes over the last `window_s` seconds: (time, ok, ttft seconds or None, tpot or None)."""

    window_s: float
    samples: deque[tuple[float, bool, float | None, float | None]] = field(default_factory=deque)

    def add(self, now: float, ok: bool, ttft: float | None, tpot: float | None) -> None:
        self.samples.append((now, ok, ttft, tpot))
        self.prune(now)

    def prune(self, now: float) -> None:
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.samples.popleft()

    def summary(self, now: float, min_requests: int) -> Summary:
        self.prune(now)
        n = len(self.samples)
        errors = sum(1 for s in self.samples if not s[1])
        ttfts = [s[2] for s in self.samples if s[2] is not None]
        tpots = [s[3] for s in self.samples if s[3] is not None]
        least = max(min_requests, MIN_LATENCY_SAMPLES)
        return Summary(n, errors / n if n else 0.0, p95(ttfts, least), p95(tpots, least))


def judged(status: str, reason: str | None, http_status: int, served_by_variant: bool) -> bool | None:
    """How a finished request of a variant counts in its window, from what the variant's upstream did: True, it
    served it; False, it failed it (a 5xx, a malformed answer or an error event mid-stream, a timeout, no member of
    its pool could be asked: every circuit open, none, all draining; or another pool had to serve it); None, it says
    nothing of the variant: refused by the gateway before the variant's upstream saw it (its own 4xx: rate, budget,
    bad input, too long; its queue full), a client error the upstream answered with a 4xx, or cancelled. A request's
    outcome is gateway/request/outcome.py's (status: ok | rejected | error | timeout | cancelled; its reason)."""
    if status == "ok":
        return served_by_variant
    if status == "timeout" or (status == "error" and http_status >= 500) or reason in UNDELIVERED_REASONS:
        return False
    return None


def restarted(before: RolloutState | None, now: RolloutState) -> bool:
    """`now` is the rollout started over since `before` (the state a replica judged last): a start is the only state
    at step 0 and progressing with a `since` of its own (a step, a promotion or a rollback is never at step 0 and
    progressing). A started rollout is judged on what came after it: its windows begin empty."""
    return before is not None and now.status == PROGRESSING and now.step == 0 and now != before


def p95(values: list[float], min_count: int) -> float | None:
    """The nearest-rank 95th percentile, or None under `min_count` values (too few to judge by)."""
    if len(values) < max(1, min_count):
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def breach(canary: Summary, baseline: Summary, t: Thresholds) -> str | None:
    """Why the canary is worse than the baseline beyond the thresholds, or None (healthy, or too few to say)."""
    if canary.requests < t.min_requests or baseline.requests < t.min_requests:
        return None
    if canary.error_rate > baseline.error_rate + t.max_error_rate_delta:
        return (
            f"error rate {canary.error_rate:.1%} vs baseline {baseline.error_rate:.1%} "
            f"(allowed +{t.max_error_rate_delta:.1%})"
        )
    for name, ours, theirs, ratio, floor_ms in (
        ("TTFT p95", canary.ttft_p95, baseline.ttft_p95, t.max_ttft_p95_ratio, t.min_ttft_p95_delta_ms),
        ("TPOT p95", canary.tpot_p95, baseline.tpot_p95, t.max_tpot_p95_ratio, t.min_tpot_p95_delta_ms),
    ):
        if ours is not None and theirs is not None and ours > theirs * ratio and ours - theirs > floor_ms / 1000:
            return (
                f"{name} {ours * 1000:.1f} ms vs baseline {theirs * 1000:.1f} ms "
                f"(allowed x{ratio:g} or +{floor_ms:g} ms)"
            )
    return None


def advance(
    state: RolloutState,
    steps: list[float],
    step_s: float,
    now: float,
    canary: Summary,
    baseline: Summary,
    t: Thresholds,
    canary_reachable: bool = True,
) -> RolloutState | None:
    """The rollout's next state, or None when it stays as it is: rolled back on a breach, or at once when the
    canary has no healthy member (`canary_reachable` False: every member's circuit open, down or draining, or none)
    and its window holds a failure; one step up when the step was held `step_s` with enough of both variants judged,
    their latency included, and no breach; promoted past the last step."""
    if state.status != PROGRESSING:
        return None
    why = breach(canary, baseline, t)
    if why is None and not canary_reachable and canary.error_rate > 0:
        why = "no healthy member in the canary's pool (every circuit open, down or draining)"
    if why is not None:
        return replace(state, status=ROLLED_BACK, since=now, reason=why)
    # a step's canary share of 100% leaves no baseline to compare with: it is held, then promoted, by time alone
    alone = state.canary_share(steps) >= 100
    judged = canary.requests >= t.min_requests and (baseline.requests >= t.min_requests or alone)
    latency_judged = alone or (canary.ttft_p95 is not None and baseline.ttft_p95 is not None)
    if now - state.since < step_s or not judged or not latency_judged:
        return None
    if state.step + 1 >= len(steps):
        return RolloutState(state.step, now, PROMOTED, f"held {len(steps)} steps within the thresholds")
    return RolloutState(state.step + 1, now)
