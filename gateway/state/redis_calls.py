"""The KEYS and ARGV of `RedisState`'s script calls (gateway.state.redis_lua documents both), from the key layout
(gateway.state.redis_keys) and what the caller asks for: a reservation with its lease (RESERVE), a settle with its
lease's release (SETTLE)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenweir.gateway.state.backend import Lease
from tokenweir.gateway.state.redis_keys import RedisKeyLayout
from tokenweir.gateway.state.redis_lua import (
    LEASE_ARGV,
    RESERVE_ARGV,
    RESERVE_SUBJECT_ARGV,
    SETTLE_ARGV,
    script_args,
)
from tokenweir.gateway.state.redis_replies import UNLIMITED
from tokenweir.policies.limits import KeyLimits, TeamLimits, usd_micros
from tokenweir.policies.pricing import split_femtos
from tokenweir.policies.rate import SLOTS, WINDOW_S


def lim(value: int | None) -> int:
    return UNLIMITED if value is None else value


def reserve_call(
    layout: RedisKeyLayout,
    team_id: str,
    subjects: Sequence[tuple[str | None, TeamLimits | KeyLimits]],
    *,
    now: float,
    tokens: int,
    cost: int,
    res_id: str,
    hold_s: float,
    require_seeded: bool,
    lease: Lease | None,
    lease_s: float,
) -> tuple[list, list]:
    """RESERVE's KEYS and ARGV: the subjects' (the team, then its key) and, given a lease, the slots it takes."""
    _, _, d, m, d_exp, m_exp = layout.period_keys(team_id, now)
    slot_keys = layout.slot_keys(team_id, lease.key_id) if lease is not None else []
    lease_args: dict[str, Any] = {"lease_id": "", "max_concurrency": UNLIMITED, "key_max_concurrency": UNLIMITED}
    if lease is not None:
        lease_args |= {"lease_id": lease.lease_id, "max_concurrency": lim(lease.max_concurrency)}
        lease_args["key_max_concurrency"] = lim(lease.key_max)
    lease_args |= {"lease_s": lease_s, "slot_keys": len(slot_keys)}
    assert lease_args.keys() == set(LEASE_ARGV)
    keys: list = []
    args = script_args(
        RESERVE_ARGV,
        now=repr(now),
        tokens=tokens,
        cost=cost,
        slot_s=WINDOW_S / SLOTS,
        slots=SLOTS,
        day_period=d,
        month_period=m,
        day_expire_s=d_exp,
        month_expire_s=m_exp,
        res_id=res_id,
        hold_s=hold_s,
        require_seeded=int(require_seeded),
        **lease_args,
    )
    for key_id, limits in subjects:
        sub = layout.subject(key_id)
        day_k, month_k, *_ = layout.period_keys(team_id, now, key_id)
        keys += [layout.key(team_id, sub + "rpm"), layout.key(team_id, sub + "tpm"), day_k, month_k]
        keys += [layout.key(team_id, sub + "holds"), layout.key(team_id, sub + "meta")]
        args += script_args(
            RESERVE_SUBJECT_ARGV,
            rpm_limit=lim(limits.rpm),
            tpm_limit=lim(limits.tpm),
            day_limit=lim(limits.tokens_per_day),
            month_limit=lim(limits.tokens_per_month),
            cost_day_limit=lim(usd_micros(limits.usd_per_day)),
            cost_month_limit=lim(usd_micros(limits.usd_per_month)),
            res_prefix=layout.key(team_id, sub + "res:"),
        )
    return keys + slot_keys, args


def settle_call(layout: RedisKeyLayout, op: dict) -> tuple[list, list]:
    """SETTLE's KEYS and ARGV for a settle op (as `RedisState.replay` takes it), with its "release" when it has one."""
    team_id, key_id, res_id, now, release = op["team_id"], op.get("key_id"), op["res_id"], op["now"], op.get("release")
    keys = []
    for sub_key in (None, key_id) if key_id is not None else (None,):
        sub = layout.subject(sub_key)
        day_k, month_k, d, m, d_exp, m_exp = layout.period_keys(team_id, now, sub_key)
        # KEYS per subject: tpm_window day_hash month_hash holds_zset meta_hash res_hash (lua.SETTLE_KEYS)
        keys += [layout.key(team_id, sub + "tpm"), day_k, month_k, layout.key(team_id, sub + "holds")]
        keys += [layout.key(team_id, sub + "meta"), layout.key(team_id, f"{sub}res:{res_id}")]
    slot_keys = layout.slot_keys(team_id, release["key_id"]) if release is not None else []
    cost_micros, cost_below_micro = split_femtos(op.get("cost", 0))  # exact femto-USD, split for int64 maths
    args = script_args(
        SETTLE_ARGV,
        now=repr(now),
        actual=op["tokens"],
        actual_cost=cost_micros,
        actual_cost_rem=cost_below_micro,
        slot_s=WINDOW_S / SLOTS,
        slots=SLOTS,
        day_period=d,
        month_period=m,
        day_expire_s=d_exp,
        month_expire_s=m_exp,
        res_id=res_id,
        lease_id=release["lease_id"] if release is not None else "",
        slot_keys=len(slot_keys),
    )
    return keys + slot_keys, args
