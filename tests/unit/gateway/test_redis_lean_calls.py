"""PackedCalls (gateway.state.redis_calls) packs RESERVE's and SETTLE's KEYS and ARGV from caches: what it sends must
be byte for byte what the plain lists below (reserve_call / settle_call: every argument by its name in
gateway.state.redis_lua, through script_args) would be, packed by redis_wire.bulks, whatever is cached (limits changed
at run time, a new day, a lease or none, a key or none)."""

import itertools
from collections.abc import Sequence
from typing import Any

import pytest

from tests.support.state import NOW
from tokenweir.gateway.state.backend import Lease
from tokenweir.gateway.state.redis_calls import PackedCalls, lim
from tokenweir.gateway.state.redis_keys import RedisKeyLayout
from tokenweir.gateway.state.redis_lua import LEASE_ARGV, RESERVE_ARGV, RESERVE_SUBJECT_ARGV, SETTLE_ARGV, script_args
from tokenweir.gateway.state.redis_replies import UNLIMITED
from tokenweir.gateway.state.redis_wire import bulk, bulks
from tokenweir.policies.budget import period_bounds
from tokenweir.policies.limits import KeyLimits, TeamLimits, usd_micros
from tokenweir.policies.pricing import split_femtos
from tokenweir.policies.rate import SLOTS, WINDOW_S

TEAM = TeamLimits(rpm=10, tpm=1000, tokens_per_day=10**6, usd_per_month=12.5)
KEY = KeyLimits(tpm=500, usd_per_day=0.25)
MIDNIGHT = period_bounds("day", NOW)[1]


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


def expected_reserve(layout, team_id, key_id, key_limits, lease, now, **kw):
    subjects = [(None, TEAM)] + ([(key_id, key_limits)] if key_id is not None else [])
    keys, args = reserve_call(layout, team_id, subjects, now=now, lease=lease, **kw)
    return len(keys), len(args), bulks(keys + args)


@pytest.mark.parametrize(
    ("key_id", "lease"),
    list(itertools.product([None, "k1"], [None, Lease("l1"), Lease("l2", "k1", max_concurrency=3, key_max=1)])),
)
def test_reserve_packs_what_reserve_call_lists(key_id, lease):
    layout = RedisKeyLayout("tw")
    calls = PackedCalls(layout)
    kw = {"tokens": 30, "cost": 7, "hold_s": 90.0, "require_seeded": True, "lease_s": 60.0}
    for i, now in enumerate([NOW, NOW + 0.25, MIDNIGHT - 0.5, MIDNIGHT, MIDNIGHT + 86400 * 40, NOW]):
        res_id = f"r{i}"
        got = calls.reserve("t1", TEAM, key_id, KEY, now=now, res_id=res_id, lease=lease, **kw)
        assert got == expected_reserve(layout, "t1", key_id, KEY, lease, now, res_id=res_id, **kw), now


def test_limits_changed_at_run_time_are_packed_anew():
    layout = RedisKeyLayout("tw")
    calls = PackedCalls(layout)
    kw = {"tokens": 30, "cost": 7, "res_id": "r", "hold_s": 60, "require_seeded": False, "lease_s": 60.0}
    for key_limits in [KEY, KeyLimits(tpm=500, usd_per_day=0.25), KeyLimits(tpm=501), KeyLimits(), KEY]:
        got = calls.reserve("t1", TEAM, "k1", key_limits, now=NOW, lease=None, **kw)
        assert got == expected_reserve(layout, "t1", "k1", key_limits, None, NOW, **kw), key_limits
    team = TeamLimits(rpm=11)
    got = calls.reserve("t1", team, None, None, now=NOW, lease=None, **kw)
    keys, args = reserve_call(layout, "t1", [(None, team)], now=NOW, lease=None, **kw)
    assert got == (len(keys), len(args), bulks(keys + args))


@pytest.mark.parametrize(
    ("key_id", "release"),
    list(itertools.product([None, "k1"], [None, Lease("l1").release_op("t1"), Lease("l2", "k1").release_op("t1")])),
)
def test_settle_packs_what_settle_call_lists(key_id, release):
    layout = RedisKeyLayout("tw")
    calls = PackedCalls(layout)
    for i, now in enumerate([NOW, NOW + 3.5, MIDNIGHT - 0.001, MIDNIGHT, NOW]):
        op = {"op": "settle", "team_id": "t1", "res_id": f"r{i}", "tokens": 12, "now": now, "key_id": key_id}
        op |= {"cost": 3 * 10**9 + 17} if i % 2 else {}
        if release is not None:
            op["release"] = release
        keys, args = settle_call(layout, op)
        assert calls.settle(op) == (len(keys), len(args), bulks(keys + args)), now


def test_bulk_encodes_as_redis_py_does():
    from redis._parsers.encoders import Encoder

    encoder = Encoder("utf-8", "strict", True)

    class Count(int): ...

    class Name(str): ...

    for value in ["", "héllo", b"\x00\xff", 0, -1, 10**20, 1.0, 0.1, 1e-7, repr(NOW), Count(7), Name("n")]:
        data = encoder.encode(value)
        assert bulk(value) == b"$%d\r\n%s\r\n" % (len(data), data)
    for value in [True, None, object(), bytearray(b"x")]:
        with pytest.raises(Exception, match="Invalid input"):
            bulk(value)
