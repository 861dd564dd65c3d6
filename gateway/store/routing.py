"""The routing half of `Store`: pools and aliases set at run time, as JSON documents under one version counter.

Every change bumps `routing_version` in its own transaction, and bumps it first: that row's lock (PostgreSQL) or
BEGIN IMMEDIATE (SQLite) puts writers in one line, so a writer that reads the entries after it sees every change
committed before its own, and can check the table it makes before it commits (`change_routing`). Replicas poll that
one row (cheap) and reload the entries when it moved. An entry whose body is None removes that name, a config-file
seed included.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from tokenweir.gateway.store.db import Db, now_ts

ROUTING_KINDS = ("pool", "alias")


class VersionConflict(Exception):
    """The entry changed since the version the writer read (another replica or operator wrote first)."""


@dataclass(frozen=True, slots=True)
class RoutingEntry:
    kind: str
    name: str
    body: dict | None  # None: removed
    version: int
    updated_at: str


class RoutingQueries:
    """Needs `_tx()` (one transaction) and `_read(sql, params)` from `Store`."""

    if TYPE_CHECKING:

        def _tx(self) -> AbstractContextManager[Db]: ...

        def _read(self, sql: str, params: tuple | list = ()) -> list[tuple]: ...

    def routing_version(self) -> int:
        return int(self._read("SELECT version FROM routing_version WHERE id = 1")[0][0])

    def routing_entries(self) -> tuple[int, list[RoutingEntry]]:
        """The version and every entry, read together: one statement, so no change slips between them (PostgreSQL's
        transaction would take a snapshot per statement)."""
        rows = self._read(
            "SELECT v.version, e.kind, e.name, e.body, e.version, e.updated_at FROM routing_version v"
            " LEFT JOIN routing_entries e ON 1 = 1 WHERE v.id = 1 ORDER BY e.kind, e.name"
        )
        return int(rows[0][0]), [_entry(r[1:]) for r in rows if r[1] is not None]  # the migration inserts the row

    def put_routing(self, kind: str, name: str, body: dict | None, expect_version: int | None = None) -> int:
        """Write (or, with None, remove) an entry; returns the new routing version. `expect_version`: the entry's
        version the caller read (0: it had none), else VersionConflict and nothing is written."""

        def build(entries: list[RoutingEntry]) -> dict | None:
            current = next((e.version for e in entries if (e.kind, e.name) == (kind, name)), 0)
            if expect_version is not None and current != expect_version:
                raise VersionConflict(f"{kind} {name!r} changed since version {expect_version}")
            return body

        return self.change_routing(kind, name, build)

    def change_routing(self, kind: str, name: str, build: Callable[[list[RoutingEntry]], dict | None]) -> int:
        """Write the entry `build` makes from every entry as stored now (None: remove the name), in one transaction
        that no other routing write can enter between the read and the write; returns the new routing version. What
        `build` raises (a table it refuses) rolls the transaction back: nothing is written, the version stays."""
        assert kind in ROUTING_KINDS
        with self._tx() as db:
            db.execute("UPDATE routing_version SET version = version + 1 WHERE id = 1")  # first: the writers' line
            row = db.one("SELECT version FROM routing_version WHERE id = 1")
            assert row is not None
            version = int(row[0])
            rows = db.all("SELECT kind, name, body, version, updated_at FROM routing_entries ORDER BY kind, name")
            body = build([_entry(r) for r in rows])
            text = orjson.dumps(body).decode() if body is not None else None
            db.execute(
                "INSERT INTO routing_entries (kind, name, body, version, updated_at) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (kind, name) DO UPDATE SET body = excluded.body, version = excluded.version,"
                " updated_at = excluded.updated_at",
                (kind, name, text, version, now_ts()),
            )
        return version


def _entry(row: tuple) -> RoutingEntry:
    kind, name, body, version, updated_at = row
    return RoutingEntry(kind, name, orjson.loads(body) if body is not None else None, int(version), updated_at)
