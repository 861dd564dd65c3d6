"""Usage accounting off the request path: add() is a dict update; a background task flushes the totals.

Rows are summed in memory per (team, UTC day, model) and written in one transaction every `flush_interval_s` and on
close. A flush that fails puts its rows back (summed with anything added meanwhile) for the next try, so a database
outage delays usage but never loses it; close() retries and, as a last resort, logs the rows it could not write.
Each row comes from an event (`seq`): a flush also stores the writer's last seq it covers, in the same transaction,
so a crash before the flush costs nothing: start-up replays the events after that watermark (gateway/events.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import asdict

from gateway.store import Store, UsageRow
from policies.budget import day_key

log = logging.getLogger("tokenweir.usage")

# requests, prompt_tokens, completion_tokens, cached_tokens
_Totals = list[int]


class UsageRecorder:
    def __init__(self, store: Store, flush_interval_s: float = 2.0, writer: str | None = None) -> None:
        assert flush_interval_s > 0
        self.store = store
        self.writer = writer  # the event writer whose seqs the watermark counts
        self.seq = 0  # the last event seq added (the watermark the next flush stores)
        self.flush_interval_s = flush_interval_s
        self._pending: dict[tuple[str, str, str], _Totals] = {}
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
        if seq is not None:
            self.seq = max(self.seq, seq)

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
            if not self._pending:
                return 0
            batch, self._pending = self._pending, {}
            rows = [UsageRow(t, d, m, *totals) for (t, d, m), totals in batch.items()]
            watermark = (self.writer, self.seq) if self.writer is not None and self.seq else None
            write = asyncio.ensure_future(asyncio.to_thread(self.store.record_usage, rows, watermark))
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

    def _settle(self, write: asyncio.Future, batch: dict[tuple[str, str, str], _Totals], n: int) -> None:
        if write.cancelled() or write.exception() is not None:
            self.failed_flushes += 1
            self._restore(batch)
        else:
            self.flushed_rows += n

    def _restore(self, batch: dict[tuple[str, str, str], _Totals]) -> None:
        for k, totals in batch.items():
            current = self._pending.setdefault(k, [0, 0, 0, 0])
            for i, v in enumerate(totals):
                current[i] += v

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
