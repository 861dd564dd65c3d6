"""Every store behaviour, on a real SQLite file and on a real PostgreSQL (fresh schema per test)."""

from __future__ import annotations

import sqlite3
import threading
from datetime import UTC, datetime, timedelta

import pytest

from tests.support.store import open_store, pg_schema_url
from tokenweir.gateway.store import keys
from tokenweir.gateway.store.db import DB_ERRORS, migration_files, split_sql
from tokenweir.gateway.store.store import Conflict, NotFound, Store, UsageRow
from tokenweir.gateway.store.usage import KeyUsageRow
from tokenweir.policies.limits import KeyLimits, TeamLimits

ALL_VERSIONS = [version for version, _ in migration_files()]  # every migration the package ships, in order
SCHEMA_VERSION_DDL = "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name TEXT, applied_at TEXT)"


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    with open_store(request.param, tmp_path) as s:
        yield s


def test_migrations_recorded_once(store: Store):
    assert ALL_VERSIONS[:7] == [1, 2, 3, 4, 5, 6, 7]
    assert sorted(set(ALL_VERSIONS)) == ALL_VERSIONS
    assert store.schema_versions() == ALL_VERSIONS
    assert store.migrate() == []  # a second start applies nothing
    assert store.schema_versions() == ALL_VERSIONS


def test_usage_watermark_lands_with_its_rows_and_never_goes_back(store: Store):
    assert store.usage_watermark("w") == 0
    store.record_usage([UsageRow("t", "2026-01-01", "m", 1, 2, 3, 0)], watermark=("w", 7))
    assert store.usage_watermark("w") == 7 and store.usage()[0].prompt_tokens == 2
    store.record_usage([], watermark=("w", 5))  # an older flush finishing late cannot move it back
    assert store.usage_watermark("w") == 7
    with pytest.raises(DB_ERRORS):  # a bad row fails the whole transaction: the watermark stays too
        store.record_usage([UsageRow("t", "2026-01-01", None, 1, 1, 1, 0)], watermark=("w", 9))
    assert store.usage_watermark("w") == 7 and store.usage_watermark("other") == 0


def test_team_crud_and_limits_roundtrip(store: Store):
    limits = TeamLimits(
        rpm=60, tpm=10_000, tokens_per_day=1_000_000, tokens_per_month=20_000_000, max_concurrency=4,
        max_prompt_tokens=4096, max_output_tokens=512, allowed_models=("smollm2", "other"), priority=0,
        weight=3, queue_timeout_s=2.5, ttft_timeout_s=10.0, total_timeout_s=60.0,
    )  # fmt: skip
    team = store.create_team("alpha", limits)
    assert team.limits == limits and team.enabled and team.name == "alpha"
    assert store.get_team(team.id) == team
    assert store.get_team_by_name("alpha") == team
    assert store.get_team("team_missing") is None and store.get_team_by_name("nope") is None

    beta = store.create_team("beta", enabled=False)
    assert beta.limits == TeamLimits() and not beta.enabled
    assert [t.name for t in store.list_teams()] == ["alpha", "beta"]

    renamed = store.update_team(beta.id, name="gamma", enabled=True)
    assert renamed.name == "gamma" and renamed.enabled and renamed.limits == TeamLimits()
    assert store.update_team(beta.id).name == "gamma"  # no-op update changes nothing

    new_limits = TeamLimits(rpm=1, allowed_models=())
    assert store.set_limits(beta.id, new_limits).limits == new_limits
    assert store.get_team(beta.id).limits.allowed_models == ()  # empty list (nothing allowed) is not None


def test_duplicate_names_conflict(store: Store):
    a = store.create_team("alpha")
    b = store.create_team("beta")
    with pytest.raises(Conflict):
        store.create_team("alpha")
    with pytest.raises(Conflict):
        store.update_team(b.id, name="alpha")
    assert store.update_team(a.id, name="alpha").name == "alpha"  # renaming to its own name is fine
    assert len(store.list_teams()) == 2


def test_missing_team_raises_not_found(store: Store):
    with pytest.raises(NotFound):
        store.update_team("team_missing", enabled=False)
    with pytest.raises(NotFound):
        store.set_limits("team_missing", TeamLimits())
    with pytest.raises(NotFound):
        store.delete_team("team_missing")
    with pytest.raises(NotFound):
        store.create_key("team_missing", "k")
    with pytest.raises(NotFound):
        store.revoke_key("key_missing")


def test_keys_are_stored_hashed_and_found(store: Store):
    team = store.create_team("alpha")
    secret, key = store.create_key(team.id, "ci")
    assert keys.is_well_formed(secret) and key.prefix == secret[:7] and not key.is_admin
    assert store.find_key(secret) == key
    assert store.find_key(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
    # The secret itself is nowhere in the database, only its hash.
    conn = store._conn
    rows = conn.execute("SELECT key_hash, prefix FROM api_keys").fetchall()
    assert rows == [(keys.hash_secret(secret), secret[:7])]

    admin_secret, admin = store.create_key(None, "root", is_admin=True)
    assert admin.team_id is None and admin.is_admin and store.find_key(admin_secret) == admin
    assert [k.id for k in store.list_keys()] == [key.id, admin.id]
    assert [k.id for k in store.list_keys(team.id)] == [key.id]


def test_revoke_and_expiry(store: Store):
    team = store.create_team("alpha")
    secret, key = store.create_key(team.id, "k", expires_at=datetime.now(UTC) + timedelta(hours=1))
    assert not key.is_expired() and key.is_expired(datetime.now(UTC) + timedelta(hours=2))
    revoked = store.revoke_key(key.id)
    assert revoked.revoked_at is not None
    assert store.revoke_key(key.id).revoked_at == revoked.revoked_at  # idempotent
    assert store.find_key(secret).revoked_at == revoked.revoked_at  # still found: auth says "revoked"
    _, old = store.create_key(team.id, "old", expires_at="2020-01-01T00:00:00Z")
    assert old.expires_at == "2020-01-01T00:00:00.000000Z" and old.is_expired()


def test_delete_team_removes_keys_keeps_usage(store: Store):
    team = store.create_team("alpha")
    secret, _ = store.create_key(team.id, "k")
    store.record_usage([UsageRow(team.id, "2026-03-01", "m", 1, 10, 5, 0)])
    store.delete_team(team.id)
    assert store.get_team(team.id) is None and store.find_key(secret) is None and store.list_keys() == []
    assert store.usage(team.id) == [UsageRow(team.id, "2026-03-01", "m", 1, 10, 5, 0)]
    assert store.create_team("alpha").id != team.id  # the name is free again


def test_usage_upsert_adds_and_filters(store: Store):
    a, b = store.create_team("a"), store.create_team("b")
    store.record_usage(
        [
            UsageRow(a.id, "2026-03-01", "m1", 2, 100, 50, 10),
            UsageRow(a.id, "2026-03-01", "m2", 1, 7, 3, 0),
            UsageRow(b.id, "2026-03-02", "m1", 1, 1, 1, 1),
        ]
    )
    store.record_usage([UsageRow(a.id, "2026-03-01", "m1", 3, 1000, 500, 100)])
    store.record_usage([])
    assert store.usage(a.id) == [
        UsageRow(a.id, "2026-03-01", "m1", 5, 1100, 550, 110),
        UsageRow(a.id, "2026-03-01", "m2", 1, 7, 3, 0),
    ]
    assert [r.team_id for r in store.usage(since="2026-03-02")] == [b.id]
    assert [r.model for r in store.usage(until="2026-03-01")] == ["m1", "m2"]
    assert store.usage(since="2026-03-03") == []
    assert store.spent_tokens(a.id, "2026-03-01") == 1100 + 550 + 7 + 3
    assert store.spent_tokens(a.id, "2026-03-02") == 0
    assert store.spent_tokens("team_nobody", "2000-01-01") == 0


def test_record_usage_is_one_transaction(store: Store):
    team = store.create_team("a")
    good = UsageRow(team.id, "2026-03-01", "m", 1, 1, 1, 0)
    bad = UsageRow(team.id, None, "m", 1, 1, 1, 0)  # NOT NULL violation on the second row
    with pytest.raises(Exception):  # noqa: B017 - driver-specific integrity error
        store.record_usage([good, bad])
    assert store.usage() == []  # the first row was rolled back with the second
    store.record_usage([good])  # and the store is still usable
    assert store.usage() == [good]


def test_concurrent_threads_lose_no_increment(store: Store):
    team = store.create_team("a")

    def worker():
        for _ in range(20):
            store.record_usage([UsageRow(team.id, "2026-03-01", "m", 1, 2, 3, 0)])

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.usage() == [UsageRow(team.id, "2026-03-01", "m", 80, 160, 240, 0)]


def test_later_migrations_apply_in_order_once(tmp_path):
    migrations = tmp_path / "migrations"
    migrations.mkdir()
    (migrations / "0001_a.sql").write_text(
        f"{SCHEMA_VERSION_DDL};\nCREATE TABLE t (x INTEGER); -- a comment; with a semicolon\n"
    )
    url = f"sqlite:///{tmp_path}/m.db"
    store = Store.open(url, migrations_dir=migrations)
    assert store.schema_versions() == [1]
    (migrations / "0003_c.sql").write_text("INSERT INTO t (x) VALUES (3);")
    (migrations / "0002_b.sql").write_text("ALTER TABLE t ADD COLUMN y INTEGER; INSERT INTO t (x, y) VALUES (2, 2);")
    (migrations / "README.txt").write_text("not a migration")
    assert store.migrate(migrations) == [2, 3]
    assert store.migrate(migrations) == []
    assert store._conn.execute("SELECT x, y FROM t ORDER BY rowid").fetchall() == [(2, 2), (3, None)]
    store.close()


def test_failed_migration_leaves_nothing_half_applied(tmp_path):
    migrations = tmp_path / "migrations"
    migrations.mkdir()
    (migrations / "0001_a.sql").write_text(
        f"{SCHEMA_VERSION_DDL}; CREATE TABLE t (x INTEGER); INSERT INTO nope VALUES (1);"
    )
    with pytest.raises(sqlite3.OperationalError):
        Store.open(f"sqlite:///{tmp_path}/m.db", migrations_dir=migrations)
    conn = sqlite3.connect(tmp_path / "m.db")
    assert conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall() == []


def test_postgres_replicas_migrate_concurrently():
    with pg_schema_url() as url:
        stores: list[Store] = []
        errors: list[BaseException] = []

        def start():
            try:
                stores.append(Store.open(url))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=start) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and len(stores) == 3
        assert stores[0].schema_versions() == ALL_VERSIONS
        for s in stores:
            s.close()


def test_sqlite_url_forms_and_wal(tmp_path):
    mem = Store.open("sqlite://:memory:")
    assert mem.schema_versions() == ALL_VERSIONS
    mem.close()
    store = Store.open(f"sqlite:///{tmp_path}/nested/dir/x.db")
    assert (tmp_path / "nested/dir/x.db").exists()
    assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()
    with pytest.raises(ValueError, match="unsupported store url"):
        Store.open("mysql://x")


def test_split_sql_ignores_comments():
    assert split_sql("-- head; x\nCREATE TABLE a (x INT); -- tail;\n\nCREATE TABLE b (y INT);\n") == [
        "CREATE TABLE a (x INT)",
        "CREATE TABLE b (y INT)",
    ]


def test_pepper_changes_hash(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/p.db", pepper="server-secret")
    team = store.create_team("a")
    secret, key = store.create_key(team.id, "k")
    assert store.find_key(secret) == key
    assert store._conn.execute("SELECT key_hash FROM api_keys").fetchone()[0] == keys.hash_secret(
        secret, b"server-secret"
    )
    store.close()
    unpeppered = Store.open(f"sqlite:///{tmp_path}/p.db", pepper="")
    assert unpeppered.find_key(secret) is None  # a leaked table without the pepper matches nothing
    unpeppered.close()


def test_postgres_reconnects_after_the_server_drops_us():
    import psycopg

    with pg_schema_url() as url:
        store = Store.open(url)
        team = store.create_team("alpha")
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (store._conn.info.backend_pid,))
            assert store.get_team(team.id) == team  # a read retries once on a fresh connection
            admin.execute("SELECT pg_terminate_backend(%s)", (store._conn.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError):
            store.create_team("beta")  # a write is not retried blindly: the caller decides
        assert store.create_team("beta").name == "beta"  # and the next call has a new connection
        store.close()


def test_a_keys_permission_to_pick_variants_is_off_by_default_granted_and_withdrawn(store: Store):
    team = store.create_team("pickers")
    secret, key = store.create_key(team.id, "plain")
    _, tester = store.create_key(team.id, "tester", may_pick_variant=True)
    assert not key.may_pick_variant and tester.may_pick_variant and store.get_key(tester.id).may_pick_variant
    assert store.update_key(key.id, may_pick_variant=True).may_pick_variant and store.find_key(secret).may_pick_variant
    assert store.update_key(key.id).may_pick_variant  # None: as it is
    assert not store.update_key(key.id, may_pick_variant=False).may_pick_variant
    assert [k.may_pick_variant for k in store.list_keys(team.id)] == [False, True]
    _, admin = store.create_key(None, "ops", is_admin=True)
    with pytest.raises(Conflict):
        store.update_key(admin.id, may_pick_variant=True)
    with pytest.raises(NotFound):
        store.update_key("key_nope", may_pick_variant=True)


def test_key_limits_and_per_key_usage_persist(store: Store):
    team = store.create_team("keyed", TeamLimits(usd_per_day=2.5))
    assert store.get_team(team.id).limits.usd_per_day == 2.5
    limits = KeyLimits(rpm=2, tokens_per_day=100, usd_per_month=1.25, max_concurrency=1, allowed_models=("m",))
    secret, key = store.create_key(team.id, "limited", limits=limits)
    _, plain = store.create_key(team.id, "plain")
    assert key.limits == limits and store.find_key(secret).limits == limits and plain.limits is None
    assert store.set_key_limits(key.id, KeyLimits(tpm=7)).limits == KeyLimits(tpm=7)
    assert store.set_key_limits(key.id, None).limits is None
    with pytest.raises(NotFound):
        store.set_key_limits("key_nope", KeyLimits(rpm=1))
    store.set_key_limits(plain.id, KeyLimits(rpm=3))
    assert [k.limits for k in store.list_keys(team.id)] == [None, KeyLimits(rpm=3)]

    store.record_usage(
        [UsageRow(team.id, "2026-03-01", "m", 3, 30, 15, 0)],
        key_rows=[
            # costs: whole micro-USD, then the femto-USD below a micro-dollar
            KeyUsageRow(team.id, key.id, "alice", "2026-03-01", "m", 1, 10, 5, 0, 700, 700_000_000),
            KeyUsageRow(team.id, key.id, "bob", "2026-03-01", "m", 1, 10, 5, 0, 700),
            KeyUsageRow(team.id, plain.id, "alice", "2026-03-01", "m", 1, 10, 5, 0, 700),
        ],
    )
    alice = KeyUsageRow(team.id, key.id, "alice", "2026-03-01", "m", 1, 1, 1, 0, 10, 600_000_000)
    store.record_usage([], key_rows=[alice])
    # the upsert carries 1.3e9 femto-USD into a whole micro-dollar: 711 micro-USD and 3e8 femto-USD, exactly
    assert store._read(
        "SELECT cost_micros, cost_rem_femtos FROM usage_daily_keys WHERE key_id = ? AND user_id = 'alice'", (key.id,)
    ) == [(711, 300_000_000)]
    micro = 10**9  # femto-USD: reports sum the exact cost
    assert sorted(store.usage_by("key", team.id)) == sorted(
        [
            (team.id, key.id, "2026-03-01", "m", 3, 21, 11, 0, 1411 * micro + 300_000_000),
            (team.id, plain.id, "2026-03-01", "m", 1, 10, 5, 0, 700 * micro),
        ]
    )
    users = {r[1]: r for r in store.usage_by("user", team.id, since="2026-03-01", until="2026-03-01")}
    assert users["alice"][4:] == (3, 21, 11, 0, 1411 * micro + 300_000_000)
    assert users["bob"][4:] == (1, 10, 5, 0, 700 * micro)
    assert store.usage_by("user", team.id, since="2026-03-02") == []
    spent = {k: (tokens, cost) for _, k, tokens, cost in store.spent_by_key("2026-03-01", femtos=True)}
    assert spent == {key.id: (32, 1411 * micro + 300_000_000), plain.id: (15, 700 * micro)}
    spent = {k: (tokens, cost) for _, k, tokens, cost in store.spent_by_key("2026-03-01")}
    assert spent == {key.id: (32, 1411), plain.id: (15, 700)}  # whole micro-USD, what spend budgets count

    store.delete_team(team.id)  # its keys' limits go with it; the usage rows stay for billing
    assert store.get_key(key.id) is None and store.spent_by_key("2026-03-01")


def test_routing_entries_versioned_removable_and_compare_and_set(store: Store):
    from tokenweir.gateway.store.routing import VersionConflict

    assert store.routing_entries() == (0, [])
    v1 = store.put_routing("pool", "m", {"model": "m", "upstreams": []})
    v2 = store.put_routing("alias", "a", {"alias": {"model": "a"}})
    assert store.routing_version() == v2 > v1 > 0
    version, entries = store.routing_entries()
    assert version == v2 and [(e.kind, e.name, e.version) for e in entries] == [("alias", "a", v2), ("pool", "m", v1)]
    with pytest.raises(VersionConflict):  # another writer moved it since v1 - 1
        store.put_routing("pool", "m", None, expect_version=v1 - 1)
    assert store.routing_entries()[1][1].body == {"model": "m", "upstreams": []}  # the conflict wrote nothing
    with pytest.raises(VersionConflict):  # 0 means "it has no entry yet": it has one
        store.put_routing("pool", "m", {}, expect_version=0)
    v3 = store.put_routing("pool", "m", None, expect_version=v1)  # removed: a tombstone that outranks a seed
    assert store.routing_entries()[1][1].body is None and store.routing_entries()[1][1].version == v3
    assert store.put_routing("pool", "new", {"x": 1}, expect_version=0) == v3 + 1
