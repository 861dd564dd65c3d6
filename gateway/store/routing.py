"""The routing half of `Store`: pools and aliases set at run time, as JSON documents under one version counter.

Every change bumps `routing_version` in its own transaction; replicas poll that one row (cheap) and reload the
entries when it moved. An entry whose body is None removes that name, a config-file seed included.
"""

from __future__ import annotations

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
        """The version and every entry, read together (one transaction: no change slips between them)."""
        with self._tx() as db:
            version = db.one("SELECT version FROM routing_version WHERE id = 1")
            rows = db.all("SELECT kind, name, body, version, updated_at FROM routing_entries ORDER BY kind, name")
        assert version is not None  # the migration inserts the row
        entries = [RoutingEntry(k, n, orjson.loads(b) if b is not None else None, int(v), u) for k, n, b, v, u in rows]
        return int(version[0]), entries

    def put_routing(self, kind: str, name: str, body: dict | None, expect_version: int | None = None) -> int:
        """Write (or, with None, remove) an entry; returns the new routing version. `expect_version`: the entry's
        version the caller read (0: it had none), else VersionConflict and nothing is written."""
        assert kind in ROUTING_KINDS
        with self._tx() as db:
            # The counter first: its row lock orders concurrent writers (PostgreSQL); SQLite's BEGIN IMMEDIATE did.
            db.execute("UPDATE routing_version SET version = version + 1 WHERE id = 1")
            row = db.one("SELECT version FROM routing_version WHERE id = 1")
            assert row is not None
            version = int(row[0])
            current = db.one("SELECT version FROM routing_entries WHERE kind = ? AND name = ?", (kind, name))
            if expect_version is not None and (int(current[0]) if current else 0) != expect_version:
                raise VersionConflict(f"{kind} {name!r} changed since version {expect_version}")
            text = orjson.dumps(body).decode() if body is not None else None
            db.execute(
                "INSERT INTO routing_entries (kind, name, body, version, updated_at) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (kind, name) DO UPDATE SET body = excluded.body, version = excluded.version,"
                " updated_at = excluded.updated_at",
                (kind, name, text, version, now_ts()),
            )
        return version
