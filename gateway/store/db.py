"""The store's SQL plumbing: one execute interface over SQLite and PostgreSQL (`Db`), the SQLite connection
settings, timestamps as text, the database errors callers map to 503, and the migrations runner
(gateway/migrations/*.sql). gateway.store.store builds the domain (teams, keys, usage) on top of this.
"""

from __future__ import annotations

import re
import sqlite3
from datetime import UTC, datetime
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import psycopg

# Package data (gateway/migrations/*.sql), found through importlib.resources so an installed wheel has it too.
MIGRATIONS_DIR: Traversable = resources.files("tokenweir.migrations")
_MIGRATION_RE = re.compile(r"^(\d{4})_[A-Za-z0-9_]+\.sql$")
# pg_advisory_xact_lock key: replicas starting together migrate one at a time.
_PG_MIGRATION_LOCK = 0x746F6B656E


def format_ts(dt: datetime) -> str:
    """Fixed-width UTC text, so timestamps compare correctly as strings in either database."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def parse_ts(value: str) -> datetime:
    dt = datetime.fromisoformat(value)
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def now_ts() -> str:
    return format_ts(datetime.now(UTC))


def split_sql(script: str) -> list[str]:
    """Statements of a migration file. Migrations keep ';' out of string literals, so this stays simple."""
    lines = [line.split("--", 1)[0] for line in script.splitlines()]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def is_integrity_error(exc: Exception) -> bool:
    return isinstance(exc, sqlite3.IntegrityError | psycopg.IntegrityError)


# What a database failure looks like, from either driver: callers map it to 503, never 500.
DB_ERRORS = (sqlite3.Error, psycopg.Error)


class Db:
    """The open transaction: one execute interface over sqlite3 ('?') and psycopg ('%s')."""

    def __init__(self, conn: Any, postgres: bool) -> None:
        self.conn = conn
        self.postgres = postgres

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.postgres else sql

    def execute(self, sql: str, params: tuple | list = ()) -> Any:
        return self.conn.execute(self._sql(sql), params) if params else self.conn.execute(sql)

    def executemany(self, sql: str, rows: list[tuple]) -> None:
        cur = self.conn.cursor()
        try:
            cur.executemany(self._sql(sql), rows)
        finally:
            cur.close()

    def all(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        return list(self.execute(sql, params).fetchall())

    def one(self, sql: str, params: tuple | list = ()) -> tuple | None:
        return self.execute(sql, params).fetchone()


def sqlite_connect(path: str) -> sqlite3.Connection:
    # isolation_level=None: we issue BEGIN/COMMIT ourselves; check_same_thread=False: our lock serialises.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


def migration_files(migrations_dir: Path | Traversable = MIGRATIONS_DIR) -> list[tuple[int, Path | Traversable]]:
    """Every NNNN_name.sql in `migrations_dir`, as (version, file), in order."""
    files = sorted((int(m.group(1)), p) for p in migrations_dir.iterdir() if (m := _MIGRATION_RE.match(p.name)))
    versions = [v for v, _ in files]
    assert len(set(versions)) == len(versions), f"two migrations share a number in {migrations_dir}"
    return files


def apply_migrations(db: Db, files: list[tuple[int, Path | Traversable]]) -> list[int]:
    """Apply, in the open transaction `db`, every migration in `files` not yet in schema_version. Returns those
    applied."""
    applied_now = []
    if db.postgres:
        db.execute("SELECT pg_advisory_xact_lock(?)", (_PG_MIGRATION_LOCK,))
        row = db.one("SELECT to_regclass('schema_version')")
        assert row is not None  # a SELECT without FROM has one row
        exists = row[0] is not None
    else:
        exists = db.one("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'") is not None
    done = {r[0] for r in db.all("SELECT version FROM schema_version")} if exists else set()
    for version, path in files:
        if version in done:
            continue
        for statement in split_sql(path.read_text()):
            db.execute(statement)
        db.execute(
            "INSERT INTO schema_version (version, name, applied_at) VALUES (?, ?, ?)",
            (version, path.name, now_ts()),
        )
        applied_now.append(version)
    return applied_now
