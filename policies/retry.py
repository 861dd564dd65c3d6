"""Retry-After values: always whole seconds >= 1, so a client never hammers with `Retry-After: 0`."""

from __future__ import annotations

import math

MAX_RETRY_AFTER_S = 31 * 24 * 3600  # a month: longest honest wait (a monthly budget's reset)


def retry_after(wait_s: float | None, fallback_s: float = 1.0) -> int:
    """Whole seconds to wait, rounded up, clamped to [1, a month]; None (unknown / never) -> fallback."""
    if wait_s is None or math.isnan(wait_s) or math.isinf(wait_s):
        wait_s = fallback_s
    return int(min(max(math.ceil(wait_s), 1), MAX_RETRY_AFTER_S))


def queue_retry_after(queued: int, capacity: int, mean_hold_s: float) -> int:
    """Time for the queue ahead to drain through `capacity` slots, each held about `mean_hold_s`."""
    assert queued >= 0 and mean_hold_s >= 0
    if capacity <= 0:
        return retry_after(None, fallback_s=max(mean_hold_s, 1.0))
    return retry_after((queued / capacity + 1) * mean_hold_s)


def reset_header(wait_s: float) -> str:
    """OpenAI's `x-ratelimit-reset-*` format: '1s', '6m0s', '1h2m3s' (rounded up to the second)."""
    total = max(0, math.ceil(wait_s))
    hours, rest = divmod(total, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"
