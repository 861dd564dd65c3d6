"""What a team's live limits state looks like from outside: the `x-ratelimit-*` headers of an admitted or refused
request, and the snapshot the admin API and /metrics read. Both state backends (gateway/state/memory.py,
gateway/state/redis.py) gather their own numbers and build these views here, so the two cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tokenweir.policies.budget import seconds_until_reset
from tokenweir.policies.limits import KeyLimits, TeamLimits, usd_micros
from tokenweir.policies.retry import reset_header


@dataclass(slots=True, frozen=True)
class WindowHeaders:
    """One rate window as its headers report it."""

    limit: int
    remaining: int
    reset_s: float


def ratelimit_headers(requests: WindowHeaders | None, tokens: WindowHeaders | None) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the limits that exist (an unlimited dimension has none)."""
    headers = {}
    for name, window in (("requests", requests), ("tokens", tokens)):
        if window is not None:
            headers[f"x-ratelimit-limit-{name}"] = str(window.limit)
            headers[f"x-ratelimit-remaining-{name}"] = str(window.remaining)
            headers[f"x-ratelimit-reset-{name}"] = reset_header(window.reset_s)
    return headers


def tighter(a: WindowHeaders | None, b: WindowHeaders | None) -> WindowHeaders | None:
    """Of a team's and its key's window, the one the headers report: the one with less left."""
    if a is None or b is None:
        return a or b
    return b if b.remaining < a.remaining else a


def remaining(limit: int | None, taken: int) -> int | None:
    """What is left under `limit` (None: unlimited), never below zero."""
    return None if limit is None else max(0, limit - taken)


def budget_view(
    period: str, key: str, limit: int | None, spent: int, reserved: int, overshoot: int, now: float
) -> dict[str, Any]:
    """One budget period (`period` DAY or MONTH, `key` its 'YYYY-MM-DD' / 'YYYY-MM') as the snapshot shows it."""
    return {
        "period": key,
        "limit": limit,
        "spent": spent,
        "reserved": reserved,
        "remaining": remaining(limit, spent + reserved),
        "overshoot": overshoot,
        "resets_in_s": round(seconds_until_reset(period, now), 3),
    }


def spend_view(
    period: str, key: str, limit: int | None, spent: int, reserved: int, overshoot: int, now: float
) -> dict[str, Any]:
    """`budget_view` of a spend budget: the counters are micro-USD, the view shows USD."""
    view = budget_view(period, key, limit, spent, reserved, overshoot, now)
    for name in ("limit", "spent", "reserved", "remaining", "overshoot"):
        if view[name] is not None:
            view[name] = round(view[name] / 1_000_000, 6)
    return view


def team_snapshot(
    team_id: str,
    *,
    in_flight: int,
    reserved_tokens: int,
    open_reservations: int,
    requests_last_minute: int | None,
    tokens_last_minute: int | None,
    remaining_requests: int | None,
    remaining_tokens: int | None,
    day: dict[str, Any],
    month: dict[str, Any],
    day_usd: dict[str, Any] | None = None,
    month_usd: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A team's (or an API key's) live counters (`day` / `month` from `budget_view`, `*_usd` from `spend_view`)."""
    return {
        "team_id": team_id,
        "in_flight": in_flight,
        "reserved_tokens": reserved_tokens,
        "open_reservations": open_reservations,
        "requests_last_minute": requests_last_minute,
        "tokens_last_minute": tokens_last_minute,
        "remaining_requests": remaining_requests,
        "remaining_tokens": remaining_tokens,
        "day": day,
        "month": month,
        "spent_today": day["spent"],
        "spent_month": month["spent"],
        "remaining_day": day["remaining"],
        "remaining_month": month["remaining"],
        "day_usd": day_usd,
        "month_usd": month_usd,
    }


def with_limits(snapshot: dict[str, Any], limits: TeamLimits | KeyLimits) -> dict[str, Any]:
    """`snapshot` (a `team_snapshot`) as it reads under `limits` (a TeamLimits or KeyLimits): the current ones, not
    those the backend last saw at a reserve, so a limit an admin just set shows what is left of it at once."""
    out = dict(snapshot)

    def window(limit: int | None, used: int | None) -> int | None:
        return remaining(limit, used or 0)  # a window a backend keeps only under a limit starts empty

    out["remaining_requests"] = window(limits.rpm, snapshot["requests_last_minute"])
    out["remaining_tokens"] = window(limits.tpm, snapshot["tokens_last_minute"])
    for name, limit in (("day", limits.tokens_per_day), ("month", limits.tokens_per_month)):
        view = out[name] = dict(snapshot[name])
        view["limit"], view["remaining"] = limit, remaining(limit, view["spent"] + view["reserved"])
        out[f"remaining_{name}"] = view["remaining"]
    for name, usd in (("day_usd", limits.usd_per_day), ("month_usd", limits.usd_per_month)):
        if snapshot.get(name) is None:
            continue
        view = out[name] = dict(snapshot[name])
        limit = usd_micros(usd)
        # spent is exact (femto-USD rendered once); a budget counts its whole micro-USD, as the checks do
        taken = math.floor(view["spent"] * 1_000_000 + 1e-6) + round(view["reserved"] * 1_000_000)
        left = remaining(limit, taken)
        view["limit"] = None if limit is None else round(limit / 1_000_000, 6)
        view["remaining"] = None if left is None else round(left / 1_000_000, 6)
    return out
