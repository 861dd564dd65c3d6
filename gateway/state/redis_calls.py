"""The KEYS and ARGV of `RedisState`'s script calls (gateway.state.redis_lua documents both), from the key layout
(gateway.state.redis_keys) and what the caller asks for: a reservation with its lease (RESERVE), a settle with its
lease's release (SETTLE).

`PackedCalls` builds them as the wire sends them (RESP bulk strings, gateway.state.redis_wire), from caches of what
does not change from one request to the next: a subject's KEYS per team, key and budget period, its limits' ARGV per
limits (looked up by identity, then by value, so limits changed at run time are seen on the next call).
tests/unit/gateway/test_redis_lean_calls.py writes the same calls as plain lists, by argument name, and checks that
both agree byte for byte.
"""

from __future__ import annotations

from typing import Any, TypeVar

from tokenweir.gateway.state.backend import Lease
from tokenweir.gateway.state.redis_keys import RedisKeyLayout
from tokenweir.gateway.state.redis_lua import (
    RESERVE_ARGV,
    RESERVE_SUBJECT_ARGV,
    SETTLE_ARGV,
)
from tokenweir.gateway.state.redis_replies import UNLIMITED
from tokenweir.gateway.state.redis_wire import bulk, bulks
from tokenweir.policies.limits import KeyLimits, TeamLimits, usd_micros
from tokenweir.policies.pricing import split_femtos
from tokenweir.policies.rate import SLOTS, WINDOW_S


def lim(value: int | None) -> int:
    return UNLIMITED if value is None else value


# The orders PackedCalls writes its ARGV in: RESERVE_ARGV and SETTLE_ARGV spelled out (checked at import).
_RESERVE_ORDER = ("now", "tokens", "cost", "slot_s", "slots", "day_period", "month_period", "day_expire_s",
                  "month_expire_s", "res_id", "hold_s", "require_seeded", "lease_id", "lease_s", "max_concurrency",
                  "key_max_concurrency", "slot_keys")  # fmt: skip
_SUBJECT_ORDER = ("rpm_limit", "tpm_limit", "day_limit", "month_limit", "cost_day_limit", "cost_month_limit",
                  "res_prefix")  # fmt: skip
_SETTLE_ORDER = ("now", "actual", "actual_cost", "slot_s", "slots", "day_period", "month_period", "day_expire_s",
                 "month_expire_s", "res_id", "actual_cost_rem", "lease_id", "slot_keys")  # fmt: skip
assert (RESERVE_ARGV, RESERVE_SUBJECT_ARGV, SETTLE_ARGV) == (_RESERVE_ORDER, _SUBJECT_ORDER, _SETTLE_ORDER)

CACHE_MAX = 4096  # entries per cache: past it, a cache starts over (teams and keys seen since fill it again)
_V = TypeVar("_V")


def _remember(cache: dict[Any, _V], key: Any, value: _V) -> _V:
    if len(cache) >= CACHE_MAX:
        cache.clear()
    cache[key] = value
    return value


class PackedCalls:
    """RESERVE's and SETTLE's KEYS and ARGV packed for `HotScript.call`: (n_keys, n_args, body)."""

    def __init__(self, layout: RedisKeyLayout) -> None:
        self.layout = layout
        self._window = bulks((WINDOW_S / SLOTS, SLOTS))  # slot_s, slots
        self._periods: dict[tuple[str, str], bytes] = {}  # day_period, month_period packed
        self._reserve_keys: dict[tuple, tuple[int, bytes]] = {}
        self._subject_args: dict[tuple[str, str | None], tuple[TeamLimits | KeyLimits, bytes]] = {}
        self._settle_keys: dict[tuple, tuple[bytes, str]] = {}
        self._slot_keys: dict[tuple[str, str | None], bytes] = {}

    def _period_args(self, d: str, m: str) -> bytes:
        packed = self._periods.get((d, m))
        return packed if packed is not None else _remember(self._periods, (d, m), bulks((d, m)))

    def _slots(self, team_id: str, key_id: str | None) -> bytes:
        packed = self._slot_keys.get((team_id, key_id))
        if packed is None:
            packed = _remember(self._slot_keys, (team_id, key_id), bulks(self.layout.slot_keys(team_id, key_id)))
        return packed

    def _subject(self, team_id: str, key_id: str | None, limits: TeamLimits | KeyLimits) -> bytes:
        """A subject's ARGV (RESERVE_SUBJECT_ARGV), packed once per limits."""
        cached = self._subject_args.get((team_id, key_id))
        if cached is not None and (cached[0] is limits or cached[0] == limits):
            return cached[1]
        packed = bulks(
            (
                lim(limits.rpm),
                lim(limits.tpm),
                lim(limits.tokens_per_day),
                lim(limits.tokens_per_month),
                lim(usd_micros(limits.usd_per_day)),
                lim(usd_micros(limits.usd_per_month)),
                self.layout.key(team_id, self.layout.subject(key_id) + "res:"),
            )
        )
        return _remember(self._subject_args, (team_id, key_id), (limits, packed))[1]

    def _reserve_keys_of(
        self, team_id: str, key_id: str | None, lease: Lease | None, d: str, m: str
    ) -> tuple[int, bytes]:
        slots = () if lease is None else (lease.key_id,)
        cache_key = (team_id, key_id, slots, d, m)
        cached = self._reserve_keys.get(cache_key)
        if cached is not None:
            return cached
        layout, keys = self.layout, []
        for sub_key in (None, key_id) if key_id is not None else (None,):
            sub = layout.subject(sub_key)
            day_k, month_k = layout.budget_keys(team_id, sub_key, d, m)
            keys += [layout.key(team_id, sub + "rpm"), layout.key(team_id, sub + "tpm"), day_k, month_k]
            keys += [layout.key(team_id, sub + "holds"), layout.key(team_id, sub + "meta")]
        if lease is not None:
            keys += layout.slot_keys(team_id, lease.key_id)
        return _remember(self._reserve_keys, cache_key, (len(keys), bulks(keys)))

    def reserve(
        self,
        team_id: str,
        limits: TeamLimits,
        key_id: str | None,
        key_limits: TeamLimits | KeyLimits | None,
        *,
        now: float,
        tokens: int,
        cost: int,
        res_id: str,
        hold_s: float,
        require_seeded: bool,
        lease: Lease | None,
        lease_s: float,
    ) -> tuple[int, int, bytes]:
        """`reserve_call(layout, team_id, [(None, limits), (key_id, key_limits)] (the key's given key_id), ...)`."""
        d, m, d_exp, m_exp = self.layout.periods(now)
        n_keys, keys = self._reserve_keys_of(team_id, key_id, lease, d, m)
        if lease is None:
            lease_args = bulks(("", lease_s, UNLIMITED, UNLIMITED, 0))
        else:
            n_slots = 2 if lease.key_id is not None else 1
            lease_max, key_max = lim(lease.max_concurrency), lim(lease.key_max)
            lease_args = bulks((lease.lease_id, lease_s, lease_max, key_max, n_slots))
        parts = [keys, bulks((repr(now), tokens, cost)), self._window, self._period_args(d, m)]
        parts += [bulks((d_exp, m_exp, res_id, hold_s, int(require_seeded))), lease_args]
        parts.append(self._subject(team_id, None, limits))
        n_args = len(_RESERVE_ORDER) + len(_SUBJECT_ORDER)
        if key_id is not None:
            assert key_limits is not None
            parts.append(self._subject(team_id, key_id, key_limits))
            n_args += len(_SUBJECT_ORDER)
        return n_keys, n_args, b"".join(parts)

    def _settle_subject(self, team_id: str, sub_key: str | None, d: str, m: str) -> tuple[bytes, str]:
        """A subject's SETTLE KEYS but its res_hash (packed), and the res_hash's name but the hold's id."""
        cache_key = (team_id, sub_key, d, m)
        cached = self._settle_keys.get(cache_key)
        if cached is not None:
            return cached
        layout, sub = self.layout, self.layout.subject(sub_key)
        day_k, month_k = layout.budget_keys(team_id, sub_key, d, m)
        keys = [layout.key(team_id, sub + "tpm"), day_k, month_k, layout.key(team_id, sub + "holds")]
        keys.append(layout.key(team_id, sub + "meta"))
        return _remember(self._settle_keys, cache_key, (bulks(keys), layout.key(team_id, sub + "res:")))

    def settle(self, op: dict) -> tuple[int, int, bytes]:
        """`settle_call(layout, op)`, packed."""
        team_id, key_id, res_id, now, release = (
            op["team_id"],
            op.get("key_id"),
            op["res_id"],
            op["now"],
            op.get("release"),
        )
        d, m, d_exp, m_exp = self.layout.periods(now)
        parts = []
        for sub_key in (None, key_id) if key_id is not None else (None,):
            keys, res_prefix = self._settle_subject(team_id, sub_key, d, m)
            parts += [keys, bulk(res_prefix + res_id)]
        n_keys = 6 * (len(parts) // 2)  # per subject: its 5 cached keys and its res_hash
        n_slots = 0
        if release is not None:
            n_slots = 2 if release["key_id"] is not None else 1
            parts.append(self._slots(team_id, release["key_id"]))
            n_keys += n_slots
        cost_micros, cost_below_micro = split_femtos(op.get("cost", 0))
        parts += [bulks((repr(now), op["tokens"], cost_micros)), self._window, self._period_args(d, m)]
        lease_id = release["lease_id"] if release is not None else ""
        parts.append(bulks((d_exp, m_exp, res_id, cost_below_micro, lease_id, n_slots)))
        return n_keys, len(_SETTLE_ORDER), b"".join(parts)
