"""Requests- and tokens-per-minute as a sliding window split into slots.

A unit taken in slot k (slot width w = window/slots) is counted until slot k + slots has passed, so the
counted span `[(k_now - slots) * w, now]` always covers the true window `[now - window, now]`. Hence in ANY
interval of length `window` at most `limit` units are admitted (never the 2x burst of a token bucket at a
window edge); the price is up to one slot width of extra waiting. Fixed memory (slots + 1 counters), and the
same layout maps onto a Redis hash of slot counters for a shared backend.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# Every rate limit is per minute, counted in 1 s slots (the Redis backend's Lua uses the same layout).
WINDOW_S = 60.0
SLOTS = 60


# The slot arithmetic, in one place for both backends: SlidingWindow below, and RedisState's snapshot and headers
# (gateway/state/redis.py). The Lua scripts in gateway/state/redis_lua.py repeat it because they run inside Redis;
# test_parity_with_in_memory_state (tests/contract/state/test_state_redis.py) checks the two agree.


def slot_index(now: float, slot_s: float) -> int:
    return math.floor(now / slot_s)


def oldest_counted_slot(now: float, slot_s: float, slots: int) -> int:
    """Units in slots older than this have left the window."""
    return slot_index(now, slot_s) - slots


def slot_leaves_window_s(slot: int, now: float, slot_s: float, slots: int) -> float:
    """Seconds until units taken in `slot` stop being counted (once the current slot index passes slot + slots)."""
    return max(0.0, (slot + slots + 1) * slot_s - now)


@dataclass
class SlidingWindow:
    limit: int
    window_s: float = WINDOW_S
    slots: int = SLOTS
    _counts: deque[list[int]] = field(default_factory=deque, repr=False)  # [slot_index, units], oldest first
    _used: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        assert self.limit >= 0 and self.window_s > 0 and self.slots >= 1

    @property
    def slot_s(self) -> float:
        return self.window_s / self.slots

    def _slot(self, now: float) -> int:
        return slot_index(now, self.slot_s)

    def _expire(self, now: float) -> None:
        oldest_counted = oldest_counted_slot(now, self.slot_s, self.slots)
        while self._counts and self._counts[0][0] < oldest_counted:
            self._used -= self._counts.popleft()[1]

    def used(self, now: float) -> int:
        self._expire(now)
        return self._used

    def remaining(self, now: float) -> int:
        return max(0, self.limit - self.used(now))

    def fits(self, n: int, now: float) -> bool:
        assert n >= 0
        return self.used(now) + n <= self.limit

    def take(self, n: int, now: float) -> bool:
        """Check-and-take: take n units if they fit, else take nothing."""
        if not self.fits(n, now):
            return False
        self.add(n, now)
        return True

    def add(self, n: int, now: float) -> None:
        """Count n units at `now` unconditionally (an overshoot settled after the fact still counts)."""
        assert n >= 0
        self._expire(now)
        if n == 0:
            return
        slot = self._slot(now)
        if self._counts and self._counts[-1][0] >= slot:  # clock stepped back: count in the newest slot
            self._counts[-1][1] += n
        else:
            self._counts.append([slot, n])
        self._used += n

    def refund(self, n: int, taken_at: float, now: float) -> int:
        """Give back up to n units taken at `taken_at` (expired ones are gone); returns how many came back."""
        assert n >= 0
        self._expire(now)
        slot = self._slot(taken_at)
        for entry in reversed(self._counts):  # newest first: a refund is almost always for a request just taken
            if entry[0] == slot:
                back = min(n, entry[1])
                entry[1] -= back
                self._used -= back
                return back
        return 0

    def wait_s(self, n: int, now: float) -> float | None:
        """Seconds until n units fit (0 if they fit now); None if they never can (n > limit)."""
        if n > self.limit:
            return None
        used = self.used(now)
        if used + n <= self.limit:
            return 0.0
        freed = 0
        for slot, units in self._counts:
            freed += units
            if used - freed + n <= self.limit:
                return slot_leaves_window_s(slot, now, self.slot_s, self.slots)
        return self.window_s  # unreachable while the counters are consistent; a safe answer anyway

    def reset_s(self, now: float) -> float:
        """Seconds until the window is empty again (for `x-ratelimit-reset-*`)."""
        self._expire(now)
        if not self._counts:
            return 0.0
        return slot_leaves_window_s(self._counts[-1][0], now, self.slot_s, self.slots)
