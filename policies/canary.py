"""Canary rollouts: where a rollout stands, the canary's share it gives, and the verdict on its indicators.

A rollout steps a canary variant's share of the subjects up a list of percentages. At each step the canary and
the baseline are compared over a sliding window (with a minimum sample of each): an error rate above the
baseline's by more than a margin, or a TTFT p95 or TPOT p95 above the baseline's by more than a ratio, is a breach
(rolled back: share 0); a step held long enough with no breach moves to the next; past the last, promoted (100%).
Pure: the windows are filled and the state stored by gateway/upstream/rollouts.py.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

PROGRESSING, PROMOTED, ROLLED_BACK = "progressing", "promoted", "rolled_back"
# A p95 of fewer values is their maximum: one slow request would decide. Latency is judged on at least this many.
MIN_LATENCY_SAMPLES = 20


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


def judged(status: str, http_status: int, served_by_variant: bool) -> bool | None:
    """How a finished request of a variant counts in its window, from what the variant's upstream did: True, it
    served it; False, it failed it (a 5xx, no instance of it answered, a timeout, or another pool had to serve it);
    None, it says nothing of the variant: refused by the gateway before the variant's upstream saw it (its own 4xx:
    rate, budget, bad input, too long; or 503 with no instance to try), a client error the upstream answered with a
    4xx, or cancelled. A request's outcome is gateway/request/outcome.py's (status: ok | rejected | error | timeout |
    cancelled)."""
    if status == "ok":
        return served_by_variant
    if status == "timeout" or (status == "error" and http_status >= 500):
        return False
    return None


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
    for name, ours, theirs, ratio in (
        ("TTFT p95", canary.ttft_p95, baseline.ttft_p95, t.max_ttft_p95_ratio),
        ("TPOT p95", canary.tpot_p95, baseline.tpot_p95, t.max_tpot_p95_ratio),
    ):
        if ours is not None and theirs is not None and ours > theirs * ratio:
            return f"{name} {ours * 1000:.1f} ms vs baseline {theirs * 1000:.1f} ms (allowed x{ratio:g})"
    return None


def advance(
    state: RolloutState,
    steps: list[float],
    step_s: float,
    now: float,
    canary: Summary,
    baseline: Summary,
    t: Thresholds,
) -> RolloutState | None:
    """The rollout's next state, or None when it stays as it is: rolled back on a breach; one step up when the step
    was held `step_s` with enough of both variants judged and no breach; promoted past the last step."""
    if state.status != PROGRESSING:
        return None
    why = breach(canary, baseline, t)
    if why is not None:
        return replace(state, status=ROLLED_BACK, since=now, reason=why)
    # a step's canary share of 100% leaves no baseline to compare with: it is held, then promoted, by time alone
    judged = canary.requests >= t.min_requests and (
        baseline.requests >= t.min_requests or state.canary_share(steps) >= 100
    )
    if now - state.since < step_s or not judged:
        return None
    if state.step + 1 >= len(steps):
        return RolloutState(state.step, now, PROMOTED, f"held {len(steps)} steps within the thresholds")
    return RolloutState(state.step + 1, now)
