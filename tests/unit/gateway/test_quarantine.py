"""Start-up's readers set aside the lines they cannot use (gateway/accounting/quarantine.py): the event log read again
at every start quarantines a stray line once; a quarantine that cannot be written does not stop the reading; the state
outbox replays its good changes and sets aside the rest. (Through a whole start-up, on the real Redis:
tests/app/gateway/test_startup_quarantine.py.)"""

from __future__ import annotations

import asyncio

import orjson

from tokenweir.gateway.accounting.events import last_seq, replay_after
from tokenweir.gateway.state.outbox import StateOutbox

GOOD = [{"seq": 1, "ts": 1.0, "team": "t", "route": ["m@a"], "model": "m", "prompt_tokens": 3}, {"seq": 2, "ts": 2.0}]
STRAY = [b'{"seq": true, "ts": 1.5}', b'{"seq": 3, "ts": 3.0, "team": "t", "route": ["m@a"], "model": null}']


def write_log(path) -> None:
    lines = [orjson.dumps(GOOD[0]), *STRAY, orjson.dumps(GOOD[1])]
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_a_stray_event_line_is_quarantined_once_however_often_the_log_is_read(tmp_path):
    path = tmp_path / "events.jsonl"
    write_log(path)
    for _ in range(3):  # each start reads the log again (last_seq, then replay_after)
        assert last_seq(path) == 2
        assert list(replay_after(path, 0)) == GOOD
    assert (tmp_path / "events.jsonl.quarantine").read_bytes().splitlines() == STRAY


def test_a_quarantine_that_cannot_be_written_does_not_stop_the_reading(tmp_path):
    path = tmp_path / "events.jsonl"
    write_log(path)
    (tmp_path / "events.jsonl.quarantine").mkdir()  # cannot be opened for appending
    assert last_seq(path) == 2 and list(replay_after(path, 0)) == GOOD


class State:
    def __init__(self) -> None:
        self.replayed: list[dict] = []

    async def replay(self, op: dict) -> int:
        self.replayed.append(op)
        return 0


async def test_the_state_outbox_replays_its_good_changes_and_sets_aside_the_rest(tmp_path):
    path = tmp_path / "ev.outbox.jsonl"
    release = {"op": "release_slot", "team_id": "t", "lease_id": "l-1", "key_id": None}
    settle = {"op": "settle", "team_id": "t", "res_id": "r-1", "tokens": 5, "now": 1.0, "key_id": None, "cost": 0}
    stray = [
        b"[1, 2]",
        b"null",
        b'{"seq": "x"}',
        orjson.dumps({"id": "c", "op": settle | {"tokens": "five"}}),
        orjson.dumps({"id": "d", "op": {"op": "drop_everything", "team_id": "t"}}),
        orjson.dumps({"done": 7}),
    ]
    good = [orjson.dumps({"id": "a", "op": release}), orjson.dumps({"id": "b", "op": settle})]
    path.write_bytes(b"\n".join([good[0], *stray, good[1]]) + b'\n{"id": "torn')
    state = State()
    outbox = StateOutbox(state, path)
    await outbox.start()
    async with asyncio.timeout(5):
        while len(outbox):
            await asyncio.sleep(0.01)
    await outbox.close()
    assert state.replayed == [release, settle]
    assert (tmp_path / "ev.outbox.jsonl.quarantine").read_bytes().splitlines() == [*stray, b'{"id": "torn']
