"""The store's files and batches (gateway/store/files.py, batches.py) on SQLite and PostgreSQL: team-scoped reads, the
lease that lets one replica run a batch (taken over once it lapses), one row per line."""

from __future__ import annotations

import pytest

from tests.support.store import open_store
from tokenweir.gateway.store.batches import BatchRecord, LineRow
from tokenweir.gateway.store.db import is_integrity_error
from tokenweir.gateway.store.files import FileRecord


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    with open_store(request.param, tmp_path) as s:
        yield s


def a_batch(store, batch_id: str = "batch_1", team: str = "team_a", created_at: int = 100) -> BatchRecord:
    record = BatchRecord(batch_id, team, "key_1", "/v1/chat/completions", "file-1", "24h", "validating", None, 3,
                         created_at, created_at + 86400)  # fmt: skip
    return store.create_batch(record)


def test_files_are_read_only_by_their_team_and_listed_newest_first(store):
    for i in range(3):
        store.create_file(FileRecord(f"file-{i}", "team_a", "batch", f"f{i}.jsonl", 2, 100 + i), "{}")
    assert store.get_file("team_b", "file-0") is None and store.file_content("team_b", "file-0") is None
    assert store.file_content("team_a", "file-0") == "{}"
    assert [f.id for f in store.list_files("team_a", None, None, 10)] == ["file-2", "file-1", "file-0"]
    assert [f.id for f in store.list_files("team_a", None, "file-2", 1)] == ["file-1"]
    assert store.list_files("team_a", "batch_output", None, 10) == []
    assert not store.delete_file("team_b", "file-0") and store.delete_file("team_a", "file-0")
    assert store.get_file("team_a", "file-0") is None


def test_one_replica_holds_a_batch_until_its_lease_lapses(store):
    a_batch(store)
    assert store.claimable_batches("a", now=10.0) == ["batch_1"]
    assert store.claim_batch("batch_1", "a", now=10.0, until=20.0)
    assert not store.claim_batch("batch_1", "b", now=15.0, until=25.0), "a live lease is not taken"
    assert store.claimable_batches("b", now=15.0) == [] and store.claimable_batches("a", now=15.0) == ["batch_1"]
    assert store.claim_batch("batch_1", "a", now=15.0, until=25.0), "its holder renews it"
    assert store.claim_batch("batch_1", "b", now=26.0, until=36.0), "a lapsed lease is taken over"
    assert not store.claim_batch("batch_1", "a", now=27.0, until=37.0), "the old holder lost it"
    store.release_batch("batch_1", "a")  # not its holder: nothing happens
    assert not store.claim_batch("batch_1", "a", now=28.0, until=38.0)
    store.release_batch("batch_1", "b")
    assert store.claim_batch("batch_1", "a", now=28.0, until=38.0)


def test_a_line_has_one_row_and_its_end_is_recorded_once(store):
    a_batch(store)
    store.start_line("batch_1", 1, "x", "batch_1-1")
    with pytest.raises(Exception) as exc:
        store.start_line("batch_1", 1, "x", "batch_1-1")
    assert is_integrity_error(exc.value)
    store.end_lines("batch_1", [LineRow(1, "x", "batch_1-1", "done", 200, "{}")])
    store.end_lines("batch_1", [LineRow(2, "y", "batch_1-2", "done", error_code="batch_expired")])
    rows = store.batch_lines("batch_1")
    assert [(r.line, r.state, r.status_code, r.error_code) for r in rows] == [
        (1, "done", 200, None),
        (2, "done", None, "batch_expired"),
    ]
    counts = store.line_counts("batch_1")
    assert (counts.completed, counts.failed) == (1, 1)


def test_batches_are_their_teams_and_cancel_only_what_has_not_ended(store):
    a_batch(store, "batch_1", created_at=100)
    a_batch(store, "batch_2", created_at=200)
    assert store.get_batch("team_b", "batch_1") is None and store.cancel_batch("team_b", "batch_1", 5) is None
    assert [b.id for b in store.list_batches("team_a", None, 10)] == ["batch_2", "batch_1"]
    assert [b.id for b in store.list_batches("team_a", "batch_2", 10)] == ["batch_1"]
    cancelled = store.cancel_batch("team_a", "batch_1", 5)
    assert cancelled is not None and (cancelled.status, cancelled.cancelling_at) == ("cancelling", 5)
    store.finish_batch("batch_2", "completed", 300, None, None)
    ended = store.cancel_batch("team_a", "batch_2", 6)
    assert ended is not None and ended.status == "completed" and ended.cancelling_at is None
