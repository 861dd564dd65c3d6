"""Where `RedisState` keeps its state in Redis: the key layout, and the names of a team's and an API key's keys.

Layout per team (a `{team}` hash tag keeps a team's keys in one cluster slot), and the same again under
`key:<key_id>:` for each API key, limits or not (same hash tag: the team and its key are checked and taken in
one script):
  rpm / tpm           hash slot_index -> units: the same sliding window as `policies.rate.SlidingWindow`
  day:<key> month:<key>  hash spent / reserved / overshoot (tokens) and cost_spent / cost_reserved /
                      cost_overshoot (micro-USD) / cost_spent_rem (femto-USD below a micro-dollar), expiring a
                      day after the period ends
  holds               zset reservation id -> lease expiry; res:<id> hash with what the hold took
  slots               zset lease id -> lease expiry (concurrency)
"""

from __future__ import annotations

import math
from typing import Any

from tokenweir.policies.budget import DAY, MONTH, day_key, month_key, period_bounds


class RedisKeyLayout:
    """The names of one prefix's keys (`<prefix>:{<team>}:<name>`)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        # the UTC day last asked about: [start, end), its day and month keys, the month's end (computed once a day)
        self._day: tuple[float, float, str, str, float] = (0.0, 0.0, "", "", 0.0)

    def key(self, team_id: str, name: str) -> str:
        return f"{self.prefix}:{{{team_id}}}:{name}"

    @staticmethod
    def subject(key_id: str | None) -> str:
        """Where a subject's keys live under its team's hash tag: '' for the team, 'key:<id>:' for an API key."""
        return "" if key_id is None else f"key:{key_id}:"

    def slot_keys(self, team_id: str, key_id: str | None = None) -> list[str]:
        """The slots zsets a lease lives in: the team's, and the key's own when it has a concurrency cap (key_id)."""
        keys = [self.key(team_id, "slots")]
        if key_id is not None:
            keys.append(self.key(team_id, self.subject(key_id) + "slots"))
        return keys

    def periods(self, now: float) -> tuple[str, str, int, int]:
        """The budget periods at `now`: the day's and the month's keys, and the TTLs of their hashes, kept a day past
        the period's end so a snapshot at 00:00:01 can still read yesterday's numbers (relative TTLs from the
        caller's clock, so Redis's own clock never has to agree with ours). The calendar work is done once a day."""
        start, end, d, m, m_end = self._day
        if not start <= now < end:
            start, end = period_bounds(DAY, now)
            d, m, m_end = day_key(now), month_key(now), period_bounds(MONTH, now)[1]
            self._day = (start, end, d, m, m_end)
        return d, m, math.ceil(end - now) + 86400, math.ceil(m_end - now) + 86400

    def budget_keys(self, team_id: str, key_id: str | None, day: str, month: str) -> tuple[str, str]:
        """A subject's budget hashes for the day and month periods named `day` and `month` (see `periods`)."""
        sub = self.subject(key_id)
        return self.key(team_id, f"{sub}day:{day}"), self.key(team_id, f"{sub}month:{month}")

    def period_keys(self, team_id: str, now: float, key_id: str | None = None) -> tuple[str, str, str, str, int, int]:
        d, m, d_exp, m_exp = self.periods(now)
        return *self.budget_keys(team_id, key_id, d, m), d, m, d_exp, m_exp

    def snapshot_reads(self, pipe: Any, team_id: str, now: float, key_id: str | None = None) -> Any:
        """Queue on `pipe` (an asyncio pipeline) the reads of a subject's snapshot, in the order
        `redis_replies.snapshot_view` reads their replies: rpm, tpm, day, month, meta, live slots, holds."""
        day_k, month_k, *_ = self.period_keys(team_id, now, key_id)
        sub = self.subject(key_id)
        pipe.hgetall(self.key(team_id, sub + "rpm")).hgetall(self.key(team_id, sub + "tpm"))
        pipe.hgetall(day_k).hgetall(month_k).hgetall(self.key(team_id, sub + "meta"))
        pipe.zcount(self.key(team_id, sub + "slots"), f"({now!r}", "+inf")
        return pipe.zcard(self.key(team_id, sub + "holds"))
