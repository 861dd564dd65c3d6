"""A stray line in the files start-up reads does not stop it: with a valid-JSON line of the wrong shape in the event log
and in the in-flight journal (and a torn last line in the journal), the gateway starts, replays the good events into
usage, settles the requests the journal names (their holds and leases on the real Redis given back), and keeps the
lines it could not use in `<file>.quarantine` (gateway/accounting/quarantine.py)."""

from __future__ import annotations

import asyncio
import time
import types

import orjson
import pytest
import redis

from tests.support.serve_thread import serve_app
from tests.support.state import URL
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.request.context import RequestContext
from tokenweir.gateway.request.inflight import InflightJournal, journal_path
from tokenweir.gateway.state.redis import RedisState
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

UPSTREAM = "http://127.0.0.1:9"  # nothing answers there: the journal's attempts are external, billed at their bound
HOP = types.SimpleNamespace(
    instance=types.SimpleNamespace(cfg=types.SimpleNamespace(base_url=UPSTREAM, engine=False)),
    label="m@a",
    model="m",
)
REQUESTS = 3
PROMPT, MAX = 10, 20  # each journaled request's
EVENT_USAGE = (3, 4)  # each good event's prompt and completion tokens


def bad_lines(team_id: str) -> dict[str, tuple[bytes, bytes]]:
    """case -> (a line for the event log, one for the journal)."""
    served = {"seq": 2, "ts": time.time(), "team": team_id, "route": ["m@a"], "model": "m", "served_model": "m"}
    release = {"op": "release_slot", "team_id": team_id, "lease_id": 7, "key_id": None}
    return {
        "a-list": (b"[1, 2]", b"[1, 2]"),
        "null": (b"null", b"null"),
        "a-seq-not-a-number": (b'{"seq": "x"}', b'{"seq": "x"}'),
        "a-field-of-the-wrong-type": (
            orjson.dumps(served | {"prompt_tokens": "many"}),
            orjson.dumps({"k": "stray", "t": "slot", "release": release}),
        ),
    }


def request(i: int, team_id: str, key_id: str, reservation) -> RequestContext:
    ctx = RequestContext(
        request_id=f"r-{i}",
        kind="completions",
        body={},
        team_id=team_id,
        key_id=key_id,
        limits=TeamLimits(),
        model="m",
        stream=True,
        t0=0.0,
        deadline_base=0.0,
        priority=0,
        prompt_tokens=PROMPT,
        max_tokens=MAX,
    )
    ctx.reservation = reservation
    ctx.upstream_id = f"tw-{i}"
    return ctx


async def take_holds_and_leases(prefix: str, team_id: str, key_id: str) -> list[tuple]:
    """What a killed process took on the shared state for each of its requests: a hold and a concurrency lease, each
    on the team's and the key's zsets."""
    state = RedisState(URL, prefix=prefix)
    try:
        taken = []
        for i in range(REQUESTS):
            res = await state.reserve(team_id, TeamLimits(), PROMPT, MAX, key_id=key_id)
            lease_id = f"lease-{i}"
            assert await state.acquire_slot(team_id, 10, key_id=key_id, lease_id=lease_id)
            taken.append((res, lease_id))
        return taken
    finally:
        await state.close()


def held(client: redis.Redis, prefix: str) -> dict[str, int]:
    """Every hold and lease left under the prefix, by zset."""
    out = {}
    for key in client.scan_iter(f"{prefix}:*"):
        name = key.decode()
        if name.endswith(("holds", "slots")) and (n := client.zcard(key)):
            out[name] = n
    return out


@pytest.mark.parametrize("case", ["a-list", "null", "a-seq-not-a-number", "a-field-of-the-wrong-type"])
def test_a_stray_line_in_the_event_log_or_the_journal_is_quarantined_and_everything_else_recovered(
    tmp_path, redis_prefix, redis_client, case
):
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    team = store.create_team("t", TeamLimits(tokens_per_day=1_000_000))
    _, key = store.create_key(team.id, "k")
    bad_event, bad_journal_line = bad_lines(team.id)[case]

    events = tmp_path / "events.jsonl"
    good = {"team": team.id, "key_id": key.id, "route": ["m@a"], "model": "m", "served_model": "m", "status": "ok"}
    good |= {"prompt_tokens": EVENT_USAGE[0], "completion_tokens": EVENT_USAGE[1]}
    lines = [
        orjson.dumps(good | {"seq": 1, "ts": time.time(), "upstream_request_id": "up-1"}),
        bad_event,
        orjson.dumps(good | {"seq": 3, "ts": time.time(), "upstream_request_id": "up-3"}),
    ]
    events.write_bytes(b"\n".join(lines) + b"\n")

    taken = asyncio.run(take_holds_and_leases(redis_prefix, team.id, key.id))
    journal = InflightJournal(journal_path(events))
    journal.open()
    for i, (res, lease_id) in enumerate(taken):
        ctx = request(i, team.id, key.id, res)
        journal.reserved(ctx)
        journal.slot(ctx, lease_id=lease_id, key_id=key.id)
        journal.hop(ctx, HOP)
        if i == 0:
            journal._write(bad_journal_line + b"\n")  # between the lines of the requests it recovers
    journal._write(b'{"k": "torn')  # and the kill came mid-write
    journal.close()
    before = held(redis_client, redis_prefix)
    assert sorted(before.values()) == [REQUESTS] * 4, "a hold and a lease each, on the team's and the key's zsets"

    config = GatewayConfig(
        port=0,
        pools=[PoolConfig(model="m", upstreams=[UpstreamConfig(UPSTREAM, name="a")])],
        events=EventsConfig(path=str(events), writer_id="w"),
    )
    state = RedisState(URL, prefix=redis_prefix)
    with serve_app(config, store=store, state_backend=state) as gw:  # it started
        gw.call(state.close())
    try:
        rows = store.usage(team.id)
        billed = (sum(r.prompt_tokens for r in rows), sum(r.completion_tokens for r in rows))
        assert billed == (2 * EVENT_USAGE[0] + REQUESTS * PROMPT, 2 * EVENT_USAGE[1] + REQUESTS * MAX), rows
        written = [e for e in read_events(events) if isinstance(e, dict)]  # the stray line is still in the log
        died = sorted(e["request_id"] for e in written if e.get("reason") == "worker_died")
        assert died == [f"r-{i}" for i in range(REQUESTS)], "each journaled request settled, with its event"
        assert held(redis_client, redis_prefix) == {}, "no hold or lease left of the recovered requests"

        assert (tmp_path / "events.jsonl.quarantine").read_bytes() == bad_event + b"\n"
        quarantined = (tmp_path / "events.inflight.jsonl.quarantine").read_bytes()
        assert quarantined == bad_journal_line + b'\n{"k": "torn\n', quarantined
    finally:
        store.close()
