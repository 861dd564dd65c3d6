"""What `RedisState`'s scripts and reads answer, in `InMemoryState`'s words: the RESERVE script's refusal as a
rejection, x-ratelimit-* headers from the window counts, a team's snapshot from its hashes.
"""

from __future__ import annotations

from tokenweir.policies.budget import DAY, MONTH, day_key, month_key, seconds_until_reset, spend_rejection
from tokenweir.policies.decisions import Rejected, budget_rejection, rate_rejection
from tokenweir.policies.limits import usd_micros
from tokenweir.policies.pricing import FEMTOS_PER_MICRO, femtos_to_usd
from tokenweir.policies.rate import SLOTS, WINDOW_S, oldest_counted_slot, slot_index, slot_leaves_window_s
from tokenweir.policies.snapshot import (
    WindowHeaders,
    budget_view,
    ratelimit_headers,
    remaining,
    spend_view,
    team_snapshot,
    tighter,
)

UNLIMITED = -1  # "unlimited" on the wire


def snapshot_view(team_id: str, now: float, results: list) -> dict:
    """A team's or an API key's snapshot from its pipelined reads: rpm, tpm, day, month and meta hashes, live
    slots, open holds (in that order)."""
    d, m = day_key(now), month_key(now)
    oldest = oldest_counted_slot(now, WINDOW_S / SLOTS, SLOTS)
    rpm, tpm, day, month, meta, in_flight, holds = results

    def used(window: dict) -> int:
        return sum(int(c) for s, c in window.items() if int(s) >= oldest)

    def limit(name: str) -> int | None:
        value = int(meta.get(name, UNLIMITED))
        return None if value == UNLIMITED else value

    def period(h: dict, period_name: str, key: str, limit_name: str, field="", view=budget_view) -> dict:
        spent, reserved, over = (int(h.get(field + k, 0)) for k in ("spent", "reserved", "overshoot"))
        return view(period_name, key, limit(limit_name), spent, reserved, over, now)

    def spend(h: dict, period_name: str, key: str, limit_name: str) -> dict:
        """A spend budget's view, its spent rendered once from the exact femto-USD (whole micros + the rest)."""
        view = period(h, period_name, key, limit_name, "cost_", spend_view)
        exact = int(h.get("cost_spent", 0)) * FEMTOS_PER_MICRO + int(h.get("cost_spent_rem", 0))
        return view | {"spent": femtos_to_usd(exact)}

    rpm_used, tpm_used = used(rpm), used(tpm)
    return team_snapshot(
        team_id,
        in_flight=in_flight,
        reserved_tokens=int(meta.get("reserved", 0)),
        open_reservations=holds,
        requests_last_minute=rpm_used,
        tokens_last_minute=tpm_used,
        remaining_requests=remaining(limit("rpm"), rpm_used),
        remaining_tokens=remaining(limit("tpm"), tpm_used),
        day=period(day, DAY, d, "day_limit"),
        month=period(month, MONTH, m, "month_limit"),
        day_usd=spend(day, DAY, d, "cost_day_limit"),
        month_usd=spend(month, MONTH, m, "cost_month_limit"),
    )


def _window(limit: int | None, used: int, reset: float) -> WindowHeaders | None:
    return None if limit is None else WindowHeaders(limit, max(0, limit - used), reset)


def merged_headers(subject_limits: list, used: list[int], now: float) -> dict[str, str]:
    """x-ratelimit-* as InMemoryState sends them (the team's, or where its key has less left, the key's); reset is
    when a slot taken now leaves the window."""
    slot_s = WINDOW_S / SLOTS
    reset = slot_leaves_window_s(slot_index(now, slot_s), now, slot_s, SLOTS)
    requests = tokens = None
    for i, lim in enumerate(subject_limits):
        requests = tighter(requests, _window(lim.rpm, used[2 * i], reset))
        tokens = tighter(tokens, _window(lim.tpm, used[2 * i + 1], reset))
    return ratelimit_headers(requests, tokens)


def reserve_rejection(
    code: int, detail: str, lim, rpm_used: int, tpm_used: int, n: int, cost: int, now: float, headers: dict
) -> Rejected:
    """The RESERVE script's refusal (code 1-6, see state_redis_lua.RESERVE) as InMemoryState words it."""
    if code == 1:
        return rate_rejection("requests", lim.rpm, max(0, lim.rpm - rpm_used), 1, float(detail), headers)
    if code == 2:
        wait = None if float(detail) < 0 else float(detail)
        return rate_rejection("tokens", lim.tpm, max(0, lim.tpm - tpm_used), n, wait, headers)
    period = DAY if code in (3, 5) else MONTH
    reset = seconds_until_reset(period, now)
    if code in (3, 4):
        limit = lim.tokens_per_day if code == 3 else lim.tokens_per_month
        return budget_rejection(period, limit, int(detail), n, reset, headers)
    limit = usd_micros(lim.usd_per_day if code == 5 else lim.usd_per_month)
    assert limit is not None  # the script refuses on a spend budget only where there is one
    return spend_rejection(period, limit, int(detail), cost, reset, headers)
