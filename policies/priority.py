"""Priority bands and fair shares between teams inside a band.

Bands are strict: lower priority value runs first and a band never dispatches while a lower one waits.
Inside a band, each team's service is counted and the least served (per unit of its weight) goes next: every unit
of service advances the team's pass by stride = BIG / weight. What a unit is, is the caller's: one request (stride
scheduling), or one weighted token (the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language
Models", OSDI'24: prompt tokens at dispatch, output tokens times their weight once made, `charge`). A team that
becomes active again starts no lower than the band's current minimum pass (VTC's lift), so idling cannot bank credit
for a later burst.

A full queue sheds from the bottom, not at the door: a request of a higher band (lower number) displaces the
latest-arrived waiter of the lowest-priority band below its own (`pick_displaced`), so a batch team filling the
queue cannot refuse a critical request; a request of the same or a lower band than every waiter is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from tokenweir.policies.limits import PRIORITY_BATCH, PRIORITY_CRITICAL

BIG = 1 << 40  # large so that strides of realistic weights are exact integers, no float drift

T = TypeVar("T")


def band_of(priority: int | None, default: int) -> int:
    """Clamp a requested priority into the known bands; None -> the team's default."""
    if priority is None:
        return default
    return min(max(int(priority), PRIORITY_CRITICAL), PRIORITY_BATCH)


def pick_displaced(band: int, waiters: Iterable[tuple[int, int, T]]) -> T | None:
    """Who leaves a full queue so that a request of `band` may wait: of `waiters` as (band, arrival, who), the one
    in the lowest band strictly below `band` (highest number), latest arrival first; None when no waiter's band
    is below it (the newcomer is refused instead: the same band never displaces, so arrival order holds)."""
    victim = None
    for w_band, arrival, who in waiters:
        if w_band > band and (victim is None or (w_band, arrival) > victim[:2]):
            victim = (w_band, arrival, who)
    return None if victim is None else victim[2]


def stride_of(weight: int) -> int:
    assert weight >= 1, "weights are positive integers"
    return BIG // weight


@dataclass
class StrideScheduler:
    """Weighted fair order between the active teams of one band; callers say who is active."""

    _active: dict[str, int] = field(default_factory=dict)  # team -> pass
    _stride: dict[str, int] = field(default_factory=dict)
    _last_pass: dict[str, int] = field(default_factory=dict)  # pass a team left with, kept as debt
    _order: dict[str, int] = field(default_factory=dict)  # activation order, to break ties stably
    _vtime: int = 0  # pass of the latest dispatch: the floor for a team joining an empty band
    _seq: int = 0

    def activate(self, team: str, weight: int) -> None:
        """Team has work queued. Joining starts at max(its old pass, the band's min pass)."""
        self._stride[team] = stride_of(weight)
        if team in self._active:
            return
        floor = min(self._active.values()) if self._active else self._vtime
        self._active[team] = max(self._last_pass.get(team, 0), floor)
        self._seq += 1
        self._order[team] = self._seq

    def deactivate(self, team: str) -> None:
        """Team has nothing queued any more; its pass is remembered so leaving and rejoining gains nothing."""
        if team in self._active:
            self._last_pass[team] = self._active.pop(team)
            self._order.pop(team, None)

    def peek(self) -> str | None:
        if not self._active:
            return None
        return min(self._active, key=lambda t: (self._active[t], self._order[t]))

    def served(self, team: str, units: int = 1) -> None:
        """Team got a dispatch worth `units` of service: advance its pass by that many strides."""
        assert team in self._active, f"{team} served while inactive"
        self._vtime = self._active[team]
        self._active[team] += self._stride[team] * units

    def charge(self, team: str, units: int, weight: int = 1) -> None:
        """Team got `units` more service than its dispatches were charged (the output a request made, known once it
        ended; a request let in without queueing): its pass advances as `served`'s would, whether it waits or not."""
        assert units >= 0
        if team in self._active:
            self._active[team] += self._stride[team] * units
        else:
            self._last_pass[team] = max(self._last_pass.get(team, 0), self._vtime) + stride_of(weight) * units

    def pass_of(self, team: str) -> int | None:
        return self._active.get(team, self._last_pass.get(team))
