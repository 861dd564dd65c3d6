"""Writers that race on one store: routing changes judged against the table as it is when they write (two replicas'
connections, on SQLite and PostgreSQL), and a SQLite store that writes again after a transaction it could not commit."""

from __future__ import annotations

import contextlib
import sqlite3
import threading

import pytest

from tests.support.store import pg_schema_url
from tokenweir.gateway.store.routing import RoutingEntry
from tokenweir.gateway.store.store import Store


@pytest.fixture(params=["sqlite", "postgresql"])
def two(request, tmp_path):
    """Two connections to one store, as two replicas have."""
    with contextlib.ExitStack() as stack:
        url = f"sqlite:///{tmp_path}/store.db" if request.param == "sqlite" else stack.enter_context(pg_schema_url())
        stores = [Store.open(url) for _ in range(2)]
        for s in stores:
            stack.callback(s.close)
        yield stores


def test_a_routing_change_sees_every_change_committed_before_it_and_writes_nothing_when_refused(two):
    first, second = two
    first.put_routing("pool", "n", {"count": 0})

    def add_one(store: Store) -> None:
        def build(entries: list[RoutingEntry]) -> dict:
            (entry,) = [e for e in entries if e.name == "n"]
            assert entry.body is not None
            return {"count": entry.body["count"] + 1}

        for _ in range(25):
            store.change_routing("pool", "n", build)

    threads = [threading.Thread(target=add_one, args=(s,)) for s in (first, second, first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    version, entries = second.routing_entries()
    assert entries[0].body == {"count": 100} and version == 101  # no change was built on a table another replaced

    def refuse(entries: list[RoutingEntry]) -> dict:
        raise LookupError("that table would be broken")

    with pytest.raises(LookupError):
        first.change_routing("alias", "a", refuse)
    assert second.routing_entries() == (version, entries)  # nothing written, the version where it was


def test_a_sqlite_transaction_whose_commit_fails_leaves_the_store_usable(tmp_path):
    """A COMMIT that fails (here a deferred foreign key; a busy database in rollback-journal mode alike) keeps
    SQLite's transaction open: it is rolled back, or every later write on the connection would fail."""
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    try:
        with store._tx() as db:
            db.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
            db.execute("CREATE TABLE child (p INTEGER REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)")
        with pytest.raises(sqlite3.IntegrityError), store._tx() as db:
            db.execute("INSERT INTO child (p) VALUES (1)")  # refused only at COMMIT
        assert store.create_team("a").name == "a"
        assert store.put_routing("pool", "p", {"model": "p"}) == 1
    finally:
        store.close()
