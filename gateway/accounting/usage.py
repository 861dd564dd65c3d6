"""Usage accounting off the request path: add() is a dict update; a background task flushes the totals.

Rows are summed in memory per (team, UTC day, model), and per (team, key, end user, UTC day, model) with their exact
cost (femto-USD, policies.pricing) for the per-key table, and written in one transaction every `flush_interval_s` and
on close. A flush that fails puts its rows back (summed with anything added meanwhile) for the next try, so a database
outage delays usage but never loses it; close() retries and, as a last resort, logs the rows it could not write.
Each row comes from an event (`seq`): a flush also stores the writer's last seq it covers, in the same transaction,
so a crash before the flush costs nothing: start-up replays the events after that watermark
(gateway/accounting/events.py). A request whose event (or in-flight journal line) could not be written is billed
straight to the store instead (`bill_now`), in its own transaction, with the row that keeps start-up from billing it
again (gateway/store/usage.py `settled_requests`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from dataclasses import asdict
from typing import TypeVar

from tokenweir.gateway.store.store import Store, UsageRow
from tokenweir.gateway.store.usage import KeyUsageRow, SettledRequest
from tokenweir.policies.budget import DAY, MONTH, day_key, period_start_day
from tokenweir.policies.pricing import split_femtos

log = logging.getLogger("tokenweir.usage")

# requests, prompt_tokens, completion_tokens, cached_tokens (and, per key, the exact cost in femto-USD)
_Totals = list[int]
_K = TypeVar("_K")
_Batch = tuple[dict[tuple[str, str, str], _Totals], dict[tuple[str, str, str, str, str], _Totals]]


class UsageRecorder:
    def __init__(self, store: Store, flush_interval_s: float = 2.0, writer: str | None = None) -> None:
        assert flush_interval_s > 0
        self.store = store
        self.writer = writer  # the event writer whose seqs the watermark counts
        self.seq = 0  # the last event seq added (the watermark the next flush stores)
        self.flush_interval_s = flush_interval_s
        self._pending: dict[tuple[str, str, str], _Totals] = {}
        self._pending_keys: dict[tuple[str, str, str, str, str], _Totals] = {}  # (team, key, user, day, model)
        self._flush_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._writing: asyncio.Future | None = None  # the store write in flight, awaited by close()
        self.flushed_rows = 0  # written since start, for metrics and tests
        self.failed_flushes = 0

    def add(
        self,
        team_id: str,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        *,
        requests: int = 1,
        day: str | None = None,
        seq: int | None = None,
        key_id: str | None = None,
        user: str | None = None,
        cost_femtos: int = 0,
    ) -> None:
        """Count one request. Sync and cheap: safe to call from a `finally` while the task is being cancelled."""
        # Checked here, at the caller, because a bad row would fail every later flush of the whole batch.
        assert isinstance(team_id, str) and team_id and isinstance(model, str) and model, "usage needs team and model"
        assert min(prompt_tokens, completion_tokens, cached_tokens, requests) >= 0, "usage is never negative"
        day = day or day_key(time.time())
        totals = self._pending.setdefault((team_id, day, model), [0, 0, 0, 0])
        totals[0] += requests
        totals[1] += prompt_tokens
        totals[2] += completion_tokens
        totals[3] += cached_tokens
        if key_id is not None:
            key_totals = self._pending_keys.setdefault((team_id, key_id, user or "", day, model), [0, 0, 0, 0, 0])
            for i, v in enumerate((requests, prompt_tokens, completion_tokens, cached_tokens, max(0, cost_femtos))):
                key_totals[i] += v
        if seq is not None:
            self.seq = max(self.seq, seq)

    async def bill_now(
        self,
        team_id: str,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        *,
        day: str,
        upstream_request_id: str,
        seq: int | None,
        key_id: str | None = None,
        user: str | None = None,
        cost_femtos: int = 0,
    ) -> None:
        """One request's usage written to the store now, with its settled row, in one transaction (its event or its
        journal line could not be written: `seq` is its event's, None where that did not land). Raises what the store
        raised: then nothing of it was written."""
        assert self.writer is not None, "settled rows are kept per writer"
        totals = [1, prompt_tokens, completion_tokens, cached_tokens]
        rows = [UsageRow(team_id, day, model, *totals)]
        key_rows = [_key_row((team_id, key_id, user or "", day, model), [*totals, cost_femtos])] if key_id else []
        settled = SettledRequest(self.writer, upstream_request_id, seq)
        await asyncio.to_thread(self.store.record_usage, rows, None, key_rows, settled)

    def pending(self) -> list[UsageRow]:
        """What is counted but not yet written."""
        return [UsageRow(t, d, m, *totals) for (t, d, m), totals in self._pending.items()]

    async def start(self) -> None:
        assert self._task is None, "already started"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="usage-flush")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - kept for the next try; the loop must outlive any database outage
                log.warning("usage flush failed; %d rows kept for the next try", len(self._pending), exc_info=True)

    async def flush(self) -> int:
        """Write everything pending in one transaction. Returns the rows written; on failure re-raises, rows kept."""
        async with self._flush_lock:
            if not self._pending and not self._pending_keys:
                return 0
            batch = (self._pending, self._pending_keys)
            self._pending, self._pending_keys = {}, {}
            rows = [UsageRow(t, d, m, *totals) for (t, d, m), totals in batch[0].items()]
            key_rows = [_key_row(k, totals) for k, totals in batch[1].items()]
            watermark = (self.writer, self.seq) if self.writer is not None and self.seq else None
            args = (rows, watermark, key_rows) if key_rows else (rows, watermark)
            write = asyncio.ensure_future(asyncio.to_thread(self.store.record_usage, *args))
            self._writing = write
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                # The write goes on in its thread: only its outcome may decide whether the rows are kept.
                write.add_done_callback(lambda w: self._settle(w, batch, len(rows)))
                raise
            except Exception:
                self._settle(write, batch, len(rows))
                raise
            self._settle(write, batch, len(rows))
            return len(rows)

    def _settle(self, write: asyncio.Future, batch: _Batch, n: int) -> None:
        if write.cancelled() or write.exception() is not None:
            self.failed_flushes += 1
            self._restore(batch)
        else:
            self.flushed_rows += n

    def _restore(self, batch: _Batch) -> None:
        _add_back(self._pending, batch[0])
        _add_back(self._pending_keys, batch[1])

    async def close(self, attempts: int = 3, backoff_s: float = 0.5) -> None:
        """Stop the loop and write what is left, retrying; rows that still cannot be written are logged in full."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._writing is not None:
            # A flush cancelled mid-write: let its thread finish so its rows are either written or back in pending.
            await asyncio.wait([self._writing])
            await asyncio.sleep(0)  # run its done callback
        for attempt in range(attempts):
            try:
                await self.flush()
                return
            except Exception:  # noqa: BLE001
                log.warning("final usage flush failed (attempt %d/%d)", attempt + 1, attempts, exc_info=True)
                if attempt + 1 < attempts:
                    await asyncio.sleep(backoff_s * (attempt + 1))
        for row in self.pending():
            # Last resort: the log line holds everything needed to replay the row by hand.
            log.error("usage row not written: %s", json.dumps(asdict(row)))
        for k, totals in self._pending_keys.items():
            log.error("key usage row not written: %s", json.dumps(asdict(_key_row(k, totals))))


def _add_back(pending: dict[_K, _Totals], rows: dict[_K, _Totals]) -> None:
    for k, totals in rows.items():
        current = pending.setdefault(k, [0] * len(totals))
        for i, v in enumerate(totals):
            current[i] += v


def _key_row(key: tuple[str, str, str, str, str], totals: _Totals) -> KeyUsageRow:
    """A per-key row as the store keeps it: the exact cost as whole micro-USD plus the femto-USD below one."""
    requests, prompt, completion, cached, cost_femtos = totals
    return KeyUsageRow(*key, requests, prompt, completion, cached, *split_femtos(cost_femtos))


async def seed_key_budgets(store: Store, state) -> None:
    """At start, after the teams' token budgets: the keys' own token and spend budgets and the teams' spend budgets,
    from the per-key usage rows of this UTC day / month (a restart must not hand out fresh ones)."""
    now = time.time()
    day, month = period_start_day(DAY, now), period_start_day(MONTH, now)
    # exact femto-USD: the budgets carry what is below a micro-dollar on from there
    today = await asyncio.to_thread(functools.partial(store.spent_by_key, day, femtos=True))
    this_month = await asyncio.to_thread(functools.partial(store.spent_by_key, month, femtos=True))
    by_key: dict[tuple[str, str], list[int]] = {}
    by_team: dict[str, list[int]] = {}
    for rows, i in ((today, 0), (this_month, 1)):
        for team_id, key_id, tokens, cost in rows:
            key = by_key.setdefault((team_id, key_id), [0, 0, 0, 0])
            key[i], key[2 + i] = tokens, cost
            by_team.setdefault(team_id, [0, 0])[i] += cost
    for (team_id, key_id), (d_tokens, m_tokens, d_cost, m_cost) in by_key.items():
        await state.seed_spend(team_id, d_tokens, m_tokens, key_id=key_id, day_cost=d_cost, month_cost=m_cost)
    for team_id, (d_cost, m_cost) in by_team.items():
        spent = [await asyncio.to_thread(store.spent_tokens, team_id, since) for since in (day, month)]
        await state.seed_spend(team_id, *spent, day_cost=d_cost, month_cost=m_cost)
