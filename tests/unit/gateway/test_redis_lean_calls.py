"""PackedCalls (gateway.state.redis_calls) packs RESERVE's and SETTLE's KEYS and ARGV from caches: what it sends must
be byte for byte what the plain lists of reserve_call / settle_call would be, packed by redis_wire.bulks, whatever is
cached (limits changed at run time, a new day, a lease or none, a key or none)."""

import itertools

import pytest

from tests.support.state import NOW
from tokenweir.gateway.state.backend import Lease
from tokenweir.gateway.state.redis_calls import PackedCalls, reserve_call, settle_call
from tokenweir.gateway.state.redis_keys import RedisKeyLayout
from tokenweir.gateway.state.redis_wire import bulk, bulks
from tokenweir.policies.budget import period_bounds
from tokenweir.policies.limits import KeyLimits, TeamLimits

TEAM = TeamLimits(rpm=10, tpm=1000, tokens_per_day=10**6, usd_per_month=12.5)
KEY = KeyLimits(tpm=500, usd_per_day=0.25)
MIDNIGHT = period_bounds("day", NOW)[1]


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
    for value in ["", "héllo", b"\x00\xff", 0, -1, 10**20, 1.0, 0.1, 1e-7, repr(NOW)]:
        data = encoder.encode(value)
        assert bulk(value) == b"$%d\r\n%s\r\n" % (len(data), data)
    for value in [True, None, object()]:
        with pytest.raises(Exception, match="Invalid input"):
            bulk(value)
