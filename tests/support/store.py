"""Real stores for tests: a SQLite file, or a throwaway PostgreSQL schema so parallel runs never collide."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.services import require_service
from tokenweir.gateway.store.store import Store

PG_URL = os.environ.get("TOKENWEIR_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


@contextmanager
def pg_schema_url() -> Iterator[str]:
    """A URL whose connections live in a fresh schema; the schema is dropped on exit."""
    try:
        import psycopg

        admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=3)
    except Exception as exc:  # noqa: BLE001 - any failure to connect means "no PostgreSQL here"
        require_service("postgresql", f"{PG_URL}: {exc}")
    schema = "tw_test_" + secrets.token_hex(6)
    admin.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in PG_URL else "?"
    try:
        yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        admin.execute(f"DROP SCHEMA {schema} CASCADE")
        admin.close()


@contextmanager
def open_store(kind: str, tmp_path) -> Iterator[Store]:
    if kind == "sqlite":
        store = Store.open(f"sqlite:///{tmp_path}/store.db")
        try:
            yield store
        finally:
            store.close()
        return
    with pg_schema_url() as url:
        store = Store.open(url)
        try:
            yield store
        finally:
            store.close()
