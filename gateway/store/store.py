"""Identity and usage persistence: teams, their limits, API keys and daily usage, on SQLite or PostgreSQL.

Sync by design: the gateway calls it through `asyncio.to_thread`, and only the auth cache miss is on the
request path. One connection guarded by a lock; SQLite runs in WAL mode so readers in other processes
never block. The SQL plumbing (driver differences, timestamps, migrations runner) lives in gateway.store.db.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from tokenweir.gateway.store import keys
from tokenweir.gateway.store.batches import BatchQueries
from tokenweir.gateway.store.db import (
    MIGRATIONS_DIR,
    Db,
    apply_migrations,
    format_ts,
    is_integrity_error,
    migration_files,
    now_ts,
    parse_ts,
    sqlite_connect,
)
from tokenweir.gateway.store.files import FileQueries
from tokenweir.gateway.store.records import (
    KEY_SELECT,
    TEAM_SELECT,
    ApiKey,
    Team,
    key_from_row,
    team_from_row,
    write_key_limits,
    write_limits,
)
from tokenweir.gateway.store.responses import ResponseQueries
from tokenweir.gateway.store.routing import RoutingQueries
from tokenweir.gateway.store.usage import UsageQueries, UsageRow
from tokenweir.policies.limits import KeyLimits, TeamLimits

__all__ = ["ApiKey", "Conflict", "NotFound", "Store", "StoreError", "Team", "UsageRow"]

_T = TypeVar("_T")


class StoreError(Exception):
    pass


class NotFound(StoreError):
    def __init__(self, what: str, ident: str) -> None:
        super().__init__(f"no {what} {ident!r}")
        self.what = what  # "team" or "key"
        self.ident = ident


class Conflict(StoreError):
    pass


class Store(UsageQueries, RoutingQueries, FileQueries, BatchQueries, ResponseQueries):
    """Teams, limits and keys here; the usage rows' writes and reads come from `UsageQueries`, the run-time pools'
    and aliases' from `RoutingQueries`, batch jobs' files and batches from `FileQueries` and `BatchQueries`,
    /v1/responses' stored responses from `ResponseQueries`."""

    def __init__(self, connect: Any, postgres: bool, pepper: bytes | None) -> None:
        self._connect = connect
        self.postgres = postgres
        self._pepper = pepper
        self._lock = threading.RLock()
        self._conn = connect()

    @classmethod
    def open(
        cls, url: str, *, pepper: bytes | str | None = None, migrations_dir: Path | Traversable | None = None
    ) -> Store:
        """`sqlite:///relative.db`, `sqlite:////abs/path.db`, `sqlite://:memory:` or `postgresql://...`.

        The key pepper defaults to $TOKENWEIR_KEY_PEPPER; every replica must use the same one.
        """
        if pepper is None:
            pepper = os.environ.get("TOKENWEIR_KEY_PEPPER") or None
        if isinstance(pepper, str):
            pepper = pepper.encode()
        if url.startswith(("postgresql://", "postgres://")):
            store = cls(lambda: psycopg.connect(url, autocommit=True), True, pepper)
        elif url.startswith("sqlite:"):
            path = url.removeprefix("sqlite:").removeprefix("//")
            path = path.removeprefix("/") if path != "/:memory:" else ":memory:"
            path = path or ":memory:"
            if path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            store = cls(lambda: sqlite_connect(path), False, pepper)
        else:
            raise ValueError(f"unsupported store url {url!r}: use sqlite:///path.db or postgresql://...")
        store.migrate(migrations_dir or MIGRATIONS_DIR)
        return store

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # --- plumbing ----------------------------------------

    def _connection(self) -> Any:
        # A PostgreSQL restart breaks the connection; the next call reconnects instead of failing forever.
        if self.postgres and (self._conn.closed or self._conn.broken):
            self._conn = self._connect()
        return self._conn

    @contextmanager
    def _tx(self) -> Iterator[Db]:
        with self._lock:
            conn = self._connection()
            if self.postgres:
                with conn.transaction():
                    yield Db(conn, True)
                return
            # Take the write lock up front: no read-to-write upgrade deadlocks between processes.
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield Db(conn, False)
                conn.execute("COMMIT")
            finally:
                # An error, or a COMMIT that failed (a deferred constraint; a busy file in rollback-journal mode):
                # SQLite may keep the transaction open, and every later BEGIN on this connection would fail.
                if conn.in_transaction:
                    conn.execute("ROLLBACK")

    def _read(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        with self._lock:
            try:
                return Db(self._connection(), self.postgres).all(sql, params)
            except psycopg.OperationalError:
                if not self._conn.broken:
                    raise
            # The server dropped us (restart, failover, idle kill): a read is safe to retry once, on a new connection.
            return Db(self._connection(), self.postgres).all(sql, params)

    def migrate(self, migrations_dir: Path | Traversable = MIGRATIONS_DIR) -> list[int]:
        """Apply, in order and once each, every NNNN_name.sql not in schema_version. Returns those applied."""
        files = migration_files(migrations_dir)
        with self._tx() as db:
            return apply_migrations(db, files)

    def schema_versions(self) -> list[int]:
        return [r[0] for r in self._read("SELECT version FROM schema_version ORDER BY version")]

    # --- teams ----------------------------------------

    def create_team(self, name: str, limits: TeamLimits = TeamLimits(), enabled: bool = True) -> Team:
        team_id = "team_" + secrets.token_hex(8)
        try:
            with self._tx() as db:
                if db.one("SELECT 1 FROM teams WHERE name = ?", (name,)):
                    raise Conflict(f"a team named {name!r} already exists")
                db.execute(
                    "INSERT INTO teams (id, name, enabled, created_at) VALUES (?, ?, ?, ?)",
                    (team_id, name, enabled, now_ts()),
                )
                write_limits(db, team_id, limits)
        except Exception as exc:
            if is_integrity_error(exc):  # lost a race with another replica creating the same name
                raise Conflict(f"a team named {name!r} already exists") from exc
            raise
        return _written(self.get_team(team_id))

    def get_team(self, team_id: str) -> Team | None:
        rows = self._read(TEAM_SELECT + " WHERE t.id = ?", (team_id,))
        return team_from_row(rows[0]) if rows else None

    def get_team_by_name(self, name: str) -> Team | None:
        rows = self._read(TEAM_SELECT + " WHERE t.name = ?", (name,))
        return team_from_row(rows[0]) if rows else None

    def list_teams(self) -> list[Team]:
        return [team_from_row(r) for r in self._read(TEAM_SELECT + " ORDER BY t.created_at, t.id")]

    def update_team(self, team_id: str, *, name: str | None = None, enabled: bool | None = None) -> Team:
        try:
            with self._tx() as db:
                if not db.one("SELECT 1 FROM teams WHERE id = ?", (team_id,)):
                    raise NotFound("team", team_id)
                if name is not None:
                    if db.one("SELECT 1 FROM teams WHERE name = ? AND id <> ?", (name, team_id)):
                        raise Conflict(f"a team named {name!r} already exists")
                    db.execute("UPDATE teams SET name = ? WHERE id = ?", (name, team_id))
                if enabled is not None:
                    db.execute("UPDATE teams SET enabled = ? WHERE id = ?", (enabled, team_id))
        except Exception as exc:
            if is_integrity_error(exc):
                raise Conflict(f"a team named {name!r} already exists") from exc
            raise
        return _written(self.get_team(team_id))

    def set_limits(self, team_id: str, limits: TeamLimits) -> Team:
        with self._tx() as db:
            if not db.one("SELECT 1 FROM teams WHERE id = ?", (team_id,)):
                raise NotFound("team", team_id)
            write_limits(db, team_id, limits)
        return _written(self.get_team(team_id))

    def delete_team(self, team_id: str) -> None:
        """Deletes the team, its limits and its keys; its usage rows stay for billing."""
        with self._tx() as db:
            if not db.one("SELECT 1 FROM teams WHERE id = ?", (team_id,)):
                raise NotFound("team", team_id)
            # Explicit, not ON DELETE CASCADE: SQLite ignores that on connections without the pragma.
            db.execute("DELETE FROM key_limits WHERE key_id IN (SELECT id FROM api_keys WHERE team_id = ?)", (team_id,))
            db.execute("DELETE FROM api_keys WHERE team_id = ?", (team_id,))
            db.execute("DELETE FROM team_limits WHERE team_id = ?", (team_id,))
            db.execute("DELETE FROM teams WHERE id = ?", (team_id,))

    # --- keys ----------------------------------------

    def create_key(
        self,
        team_id: str | None,
        name: str,
        *,
        is_admin: bool = False,
        expires_at: datetime | str | None = None,
        secret: str | None = None,
        limits: KeyLimits | None = None,
        may_pick_variant: bool = False,
    ) -> tuple[str, ApiKey]:
        """Returns (secret, key). The secret exists only in this return value: show it once.

        `secret`: a strong secret the operator chose (TOKENWEIR_ADMIN_KEY, keys.secret_weakness) instead of a fresh
        one; a key with that secret already stored raises Conflict. `may_pick_variant`: the key may pick an alias's
        variant by header (team keys only)."""
        assert team_id is not None or is_admin, "a key without a team must be an admin key"
        assert team_id is not None or not may_pick_variant, "an admin key makes no inference calls"
        if isinstance(expires_at, str):
            expires_at = parse_ts(expires_at)
        if secret is None:
            secret = keys.generate_secret()
        elif (weakness := keys.secret_weakness(secret)) is not None:
            raise ValueError(f"a key secret of your own is {keys.SECRET_RULE}; {weakness}")
        key_id = "key_" + secrets.token_hex(8)
        try:
            with self._tx() as db:
                if team_id is not None and not db.one("SELECT 1 FROM teams WHERE id = ?", (team_id,)):
                    raise NotFound("team", team_id)
                db.execute(
                    "INSERT INTO api_keys (id, team_id, name, prefix, key_hash, is_admin, created_at, expires_at,"
                    " may_pick_variant) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        key_id,
                        team_id,
                        name,
                        keys.visible_prefix(secret),
                        keys.hash_secret(secret, self._pepper),
                        is_admin,
                        now_ts(),
                        format_ts(expires_at) if expires_at else None,
                        may_pick_variant,
                    ),
                )
                if limits is not None:
                    write_key_limits(db, key_id, limits)
        except Exception as exc:
            if is_integrity_error(exc):  # that secret is stored already (another replica got there first)
                raise Conflict("a key with this secret already exists") from exc
            raise
        return secret, _written(self.get_key(key_id))

    def find_key(self, secret: str) -> ApiKey | None:
        """The key of this secret, revoked or expired included (the caller says which); None if unknown."""
        digest = keys.hash_secret(secret, self._pepper)
        rows = self._read(
            f"SELECT k.key_hash, {KEY_SELECT.removeprefix('SELECT ')} WHERE k.key_hash = ?",
            (digest,),
        )
        if not rows or not keys.hashes_match(rows[0][0], digest):
            return None
        return key_from_row(rows[0][1:])

    def get_key(self, key_id: str) -> ApiKey | None:
        rows = self._read(KEY_SELECT + " WHERE k.id = ?", (key_id,))
        return key_from_row(rows[0]) if rows else None

    def list_keys(self, team_id: str | None = None) -> list[ApiKey]:
        if team_id is None:
            rows = self._read(KEY_SELECT + " ORDER BY k.created_at, k.id")
        else:
            rows = self._read(KEY_SELECT + " WHERE k.team_id = ? ORDER BY k.created_at, k.id", (team_id,))
        return [key_from_row(r) for r in rows]

    def revoke_key(self, key_id: str) -> ApiKey:
        """Idempotent: revoking twice keeps the first revocation time."""
        with self._tx() as db:
            if not db.one("SELECT 1 FROM api_keys WHERE id = ?", (key_id,)):
                raise NotFound("key", key_id)
            db.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (now_ts(), key_id))
        return _written(self.get_key(key_id))

    def update_key(self, key_id: str, *, may_pick_variant: bool | None = None) -> ApiKey:
        """Change a team key's permissions (None: as it is): `may_pick_variant`, to pick an alias's variant by
        header."""
        with self._tx() as db:
            row = db.one("SELECT team_id FROM api_keys WHERE id = ?", (key_id,))
            if not row:
                raise NotFound("key", key_id)
            if row[0] is None:
                raise Conflict("an admin key has no team and makes no inference calls")
            if may_pick_variant is not None:
                db.execute("UPDATE api_keys SET may_pick_variant = ? WHERE id = ?", (may_pick_variant, key_id))
        return _written(self.get_key(key_id))

    def set_key_limits(self, key_id: str, limits: KeyLimits | None) -> ApiKey:
        """Replace a team key's own limits (None: it has none, only its team's)."""
        with self._tx() as db:
            row = db.one("SELECT team_id FROM api_keys WHERE id = ?", (key_id,))
            if not row:
                raise NotFound("key", key_id)
            if row[0] is None:
                raise Conflict("an admin key has no team and no limits")
            db.execute("DELETE FROM key_limits WHERE key_id = ?", (key_id,))
            if limits is not None:
                write_key_limits(db, key_id, limits)
        return _written(self.get_key(key_id))


def _written(row: _T | None) -> _T:
    """A team or key read back just after this call wrote it: there, unless another replica deleted it meanwhile."""
    assert row is not None
    return row
