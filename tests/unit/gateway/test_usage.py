"""UsageRecorder against real stores: batching, periodic flush, flush on close, real database failures."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time

import pytest

from tests.support.store import open_store
from tokenweir.gateway.accounting.usage import UsageRecorder, seed_key_budgets
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store, UsageRow
from tokenweir.policies.pricing import Prices, femtos_to_usd


@pytest.fixture
def store(tmp_path):
    s = Store.open(f"sqlite:///{tmp_path}/usage.db")
    yield s
    s.close()


def break_usage_table(store: Store, broken: bool) -> None:
    """A real outage of the usage table: rename it away (or back) through a separate connection."""
    a, b = ("usage_daily", "usage_daily_away") if broken else ("usage_daily_away", "usage_daily")
    if store.postgres:
        import psycopg

        with psycopg.connect(store_url(store), autocommit=True) as conn:
            conn.execute(f"ALTER TABLE {a} RENAME TO {b}")
    else:
        conn = sqlite3.connect(store._conn.execute("PRAGMA database_list").fetchone()[2])
        conn.execute(f"ALTER TABLE {a} RENAME TO {b}")
        conn.commit()
        conn.close()


def store_url(store: Store) -> str:
    return store._conn.info.dsn  # psycopg: same database, same search_path options


async def test_adds_are_summed_per_team_day_model(store):
    rec = UsageRecorder(store)
    team = store.create_team("a").id
    for _ in range(3):
        rec.add(team, "m1", 10, 5, 2)
    rec.add(team, "m2", 1, 1)
    rec.add(team, "m1", 7, 7, 0, day="2026-01-01")
    assert len(rec.pending()) == 3
    assert await rec.flush() == 3
    assert rec.pending() == [] and rec.flushed_rows == 3
    rows = {(r.day == "2026-01-01", r.model): r for r in store.usage(team)}
    today = rows[(False, "m1")]
    assert (today.requests, today.prompt_tokens, today.completion_tokens, today.cached_tokens) == (3, 30, 15, 6)
    assert rows[(False, "m2")].requests == 1
    assert rows[(True, "m1")] == UsageRow(team, "2026-01-01", "m1", 1, 7, 7, 0)
    assert await rec.flush() == 0  # nothing pending: no empty transaction
    rec.add(team, "m2", 1, 1)
    await rec.flush()
    assert store.usage(team, since=today.day)[-1].requests == 2  # a second flush adds to the stored totals


async def test_background_loop_flushes_without_being_asked(store):
    rec = UsageRecorder(store, flush_interval_s=0.05)
    await rec.start()
    rec.add("t", "m", 3, 4)
    deadline = time.monotonic() + 2.0
    while not store.usage() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await rec.close()
    assert [(r.requests, r.prompt_tokens, r.completion_tokens) for r in store.usage()] == [(1, 3, 4)]


async def test_close_flushes_what_is_left(store):
    rec = UsageRecorder(store, flush_interval_s=3600)
    await rec.start()
    for i in range(100):
        rec.add(f"team{i % 4}", "m", 1, 2)
    await rec.close()
    rows = store.usage()
    assert len(rows) == 4 and sum(r.requests for r in rows) == 100 and sum(r.completion_tokens for r in rows) == 200


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_failed_flush_keeps_rows_and_retries_without_loss(kind, tmp_path):
    with open_store(kind, tmp_path) as store:
        rec = UsageRecorder(store)
        rec.add("t", "m", 10, 1)
        break_usage_table(store, broken=True)
        with pytest.raises(Exception):  # noqa: B017 - the driver's own "no such table" error
            await rec.flush()
        assert rec.failed_flushes == 1 and rec.pending()[0].prompt_tokens == 10
        rec.add("t", "m", 5, 1)  # counted while the database is down: summed with the kept rows
        break_usage_table(store, broken=False)
        assert await rec.flush() == 1
        assert [(r.requests, r.prompt_tokens, r.completion_tokens) for r in store.usage()] == [(2, 15, 2)]


async def test_loop_survives_an_outage(store):
    rec = UsageRecorder(store, flush_interval_s=0.05)
    break_usage_table(store, broken=True)
    await rec.start()
    rec.add("t", "m", 1, 1)
    deadline = time.monotonic() + 2.0
    while rec.failed_flushes < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert rec.failed_flushes >= 2  # it kept trying
    break_usage_table(store, broken=False)
    rec.add("t", "m", 1, 1)
    await rec.close()
    assert [(r.requests, r.prompt_tokens) for r in store.usage()] == [(2, 2)]


async def test_close_logs_rows_it_cannot_write(store, caplog):
    rec = UsageRecorder(store)
    rec.add("t", "m", 9, 8, 7)
    break_usage_table(store, broken=True)
    with caplog.at_level(logging.ERROR, logger="tokenweir.usage"):
        await rec.close(attempts=2, backoff_s=0.01)
    assert rec.pending()[0].prompt_tokens == 9  # still held, not dropped
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 1 and '"prompt_tokens": 9' in lines[0] and '"team_id": "t"' in lines[0]


class SlowStore(Store):
    """A real store whose writes take a while, so a flush can be cancelled in the middle of one."""

    def record_usage(self, rows, watermark=None):
        time.sleep(0.2)
        super().record_usage(rows, watermark)


async def test_flush_cancelled_mid_write_counts_once(tmp_path):
    store = SlowStore.open(f"sqlite:///{tmp_path}/slow.db")
    rec = UsageRecorder(store, flush_interval_s=3600)
    rec.add("t", "m", 4, 4)
    flush = asyncio.create_task(rec.flush())
    await asyncio.sleep(0.05)  # the write is now running in its thread
    flush.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flush
    rec.add("t", "m", 1, 1)
    await rec.close()
    assert [(r.requests, r.prompt_tokens) for r in store.usage()] == [(2, 5)]  # neither lost nor doubled
    store.close()


async def test_bad_usage_is_refused_at_the_call_site(store):
    with pytest.raises(AssertionError):
        UsageRecorder(store).add("t", "m", -1, 0)
    with pytest.raises(AssertionError):
        UsageRecorder(store).add(None, "m", 1, 0)  # an admin key without a team has nothing to bill


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_10_000_requests_at_a_tiny_price_are_stored_and_seeded_at_their_exact_sum(kind, tmp_path):
    """14 tokens at 1e-6 USD per 1M: 1.4e-11 USD a request, 1.4e-7 USD for 10,000 (rounded up per request: $0.01).
    Ten flushes upsert onto one row; the report and the budgets seeded at a restart read the exact sum."""
    prices = Prices(1e-6, 1e-6)
    with open_store(kind, tmp_path) as store:
        rec = UsageRecorder(store)
        for i in range(10_000):
            rec.add("t", "m", 10, 4, key_id="k", user="alice", cost_femtos=prices.cost_femtos(10, 4))
            if i % 1000 == 999:
                await rec.flush()
        exact_usd, exact_femtos = 10_000 * 14 * 1e-6 / 1e6, 10_000 * 14_000
        ((*_, requests, prompt, completion, _cached, cost),) = store.usage_by("key", "t")
        assert (requests, prompt, completion) == (10_000, 100_000, 40_000)
        assert abs(femtos_to_usd(cost) - exact_usd) <= 0.01 * exact_usd and cost == exact_femtos
        state = InMemoryState()
        await seed_key_budgets(store, state)
        for key_id in (None, "k"):
            assert (await state.snapshot("t", key_id=key_id))["day_usd"]["spent"] == femtos_to_usd(exact_femtos)
