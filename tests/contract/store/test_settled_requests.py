"""Requests billed straight to the store while the event log could not take their line (gateway/store/usage.py
`settled_requests`), on a real SQLite file and a real PostgreSQL: the row lands with the usage or not at all, and is
kept exactly as long as a start-up may still read the request's event or its journal entry."""

from __future__ import annotations

import pytest

from tests.support.store import open_store
from tokenweir.gateway.store.db import DB_ERRORS
from tokenweir.gateway.store.store import Store, UsageRow
from tokenweir.gateway.store.usage import KeyUsageRow, SettledRequest

DAY = "2026-01-01"


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    with open_store(request.param, tmp_path) as s:
        yield s


def test_a_settled_request_lands_with_its_usage_and_once(store: Store):
    row, key_row = UsageRow("t", DAY, "m", 1, 8, 8, 0), KeyUsageRow("t", "k", "", DAY, "m", 1, 8, 8, 0)
    store.record_usage([row], None, [key_row], SettledRequest("w", "up-1", None))
    store.record_usage([row], None, [key_row], SettledRequest("w", "up-2", 41))
    assert store.settled_requests("w") == {"up-1": None, "up-2": 41}
    assert store.settled_requests("other-writer") == {}
    assert (store.usage()[0].requests, store.usage()[0].prompt_tokens) == (2, 16)
    with pytest.raises(DB_ERRORS):  # a bad row fails the whole transaction: no settled row either
        store.record_usage([UsageRow("t", DAY, None, 1, 1, 1, 0)], None, None, SettledRequest("w", "up-3", None))
    assert "up-3" not in store.settled_requests("w")


def test_start_up_drops_a_settled_row_once_no_file_can_bill_it_again(store: Store):
    row = UsageRow("t", DAY, "m", 1, 8, 8, 0)
    store.record_usage([row], None, None, SettledRequest("w", "no-event", None))
    store.record_usage([row], None, None, SettledRequest("w", "event-41", 41))
    store.record_usage([row], None, None, SettledRequest("w2", "other", None))
    store.prune_settled("w")  # no watermark yet: the event may be replayed
    assert store.settled_requests("w") == {"event-41": 41}, "the one without an event only mattered to the recovery"
    store.record_usage([], watermark=("w", 40))
    store.prune_settled("w")
    assert store.settled_requests("w") == {"event-41": 41}
    store.record_usage([], watermark=("w", 41))
    store.prune_settled("w")
    assert store.settled_requests("w") == {}
    assert store.settled_requests("w2") == {"other": None}, "another writer's rows are its own start-up's"
