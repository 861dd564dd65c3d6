"""One batch run to its end by the replica that holds its lease (gateway/batches/runner.py):

    validating -> in_progress -> (lines) -> finalizing -> completed | expired | cancelled

Each line goes through the request path as its own request (gateway/batches/line_call.py), at most `concurrency`
at once, and a line starts only while no interactive request (a band before the batch band) waits in a dispatch
queue: batches take the capacity interactive traffic leaves. Before a line enters admission it gets its row in the
store (`running`); its answer turns the row `done`. Lines stop being started when the batch is cancelled, its window
ends or a line is refused for the budget (`budget_exhausted`); the lines running then end as they would, the rest
are failed with that reason, and the output and error files are written with the final status in one transaction.

A resumed batch (its replica restarted, or died and another took its lease) skips every line with a `done` row. A
line still `running` was in flight when its replica died: it may have been served and billed (the in-flight
recovery of that replica bills what its upstream made), and its answer is lost, so it is failed as `interrupted`
rather than run a second time: a line is never answered, nor billed for an answer, twice.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from tokenweir.common.http.errors import APIError
from tokenweir.common.ids import random_hex
from tokenweir.common.logging import get_logger
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.auth.authenticator import Principal
from tokenweir.gateway.batches.input_lines import InputLine, parse_input
from tokenweir.gateway.batches.line_call import LineAnswer, LineCaller, line_request_id
from tokenweir.gateway.batches.output_lines import answered_ok, output_files
from tokenweir.gateway.config.batches import BatchesConfig
from tokenweir.gateway.openai.endpoints import PATH_KINDS
from tokenweir.gateway.request.queue import DispatchQueue
from tokenweir.gateway.store.batches import BatchRecord, LineRow, StoredFile
from tokenweir.gateway.store.files import FileRecord
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import PRIORITY_BATCH

log = get_logger()

_STATUS_CHECK_S = 0.25  # how often a running job re-reads its batch's status (a cancel on another replica)
_RETRY_FIRST_S, _RETRY_MAX_S = 0.05, 5.0  # a transient refusal's retry backoff (where it gave no Retry-After)
_PACING_S = 0.02  # how often a line waiting for interactive traffic to drain looks again
_SEATING_S, _SEATING_CHECKS = 0.002, 50  # how long a started line is given to take its slot (with a headroom)
# The batch's status after a stop (a batch stopped at the budget has completed: its error file says which lines
# were not run and why)
_FINAL_STATUS = {"batch_expired": "expired", "batch_cancelled": "cancelled"}


@dataclass(eq=False)
class JobDeps:
    """What every job of a replica shares."""

    store: Store
    caller: LineCaller
    queues: dict[str, DispatchQueue]
    config: BatchesConfig
    metrics: Metrics
    clock: Callable[[], float] = time.time


class BatchJob:
    def __init__(self, batch: BatchRecord, deps: JobDeps) -> None:
        self.batch, self.deps = batch, deps
        self.stop: str | None = None  # why no further line starts: budget_exhausted | batch_expired | batch_cancelled
        self.closing = False  # this replica shuts down: stop starting lines, leave the batch to be resumed
        self._checked_at = 0.0

    async def run(self) -> None:
        store, batch = self.deps.store, self.batch
        try:
            lines = await self.input_lines()
        except APIError as e:  # the file vanished or changed under it: the batch fails as OpenAI's does
            await asyncio.to_thread(store.update_batch, batch.id, status="failed", ended_at=self.now())
            log.warning("batch_failed", batch=batch.id, error=e.message)
            return
        if batch.status == "validating":
            await asyncio.to_thread(store.update_batch, batch.id, status="in_progress", in_progress_at=self.now())
        rows = {row.line: row for row in await asyncio.to_thread(store.batch_lines, batch.id)}
        await self.end_unanswered([r for r in rows.values() if r.state == "running"], "interrupted")
        todo = [line for line in lines if line.number not in rows]
        if batch.status != "finalizing":
            left = await self.run_lines(todo)
            if self.closing:
                return  # resumed later, from the rows written
            await self.end_unanswered([_unanswered(batch.id, line) for line in left], self.stop or "batch_cancelled")
        await self.finalize()

    async def input_lines(self) -> list[InputLine]:
        batch = self.batch
        content = await asyncio.to_thread(self.deps.store.file_content, batch.team_id, batch.input_file_id)
        if content is None:
            raise APIError(400, f"The input file '{batch.input_file_id}' no longer exists.", "invalid_input_file")
        return parse_input(content, batch.endpoint, self.deps.config.max_lines)

    async def run_lines(self, todo: list[InputLine]) -> list[InputLine]:
        """Run `todo` in order, paced; returns the lines not started (after a stop), once the started ones ended."""
        slots = asyncio.Semaphore(self.deps.config.concurrency)
        running: set[asyncio.Task[None]] = set()
        left: list[InputLine] = []
        try:
            for i, line in enumerate(todo):
                await slots.acquire()
                if not await self.may_start(line, running):
                    slots.release()
                    left = todo[i:]
                    break
                await asyncio.to_thread(
                    self.deps.store.start_line, self.batch.id, line.number, line.custom_id, self.request_id(line)
                )
                task = asyncio.create_task(self.run_line(line))
                running.add(task)
                await self.until_seated(line, task)

                def ended(task: asyncio.Task[None]) -> None:
                    running.discard(task)
                    slots.release()

                task.add_done_callback(ended)
        finally:
            # Cancelled (the lease lost, a shutdown past its grace): the lines running end first, their rows written.
            # Cancelled again meanwhile, they are cancelled too (each settled by its own end): their rows stay
            # `running`, and a resume fails them as interrupted.
            await asyncio.gather(*running, return_exceptions=True)
        return left

    def pool_of(self, line: InputLine) -> DispatchQueue | None:
        """The dispatch queue of the pool `line` names, if it names one (not an alias)."""
        return self.deps.queues.get(line.model) if line.model is not None else None

    def headroom_pool(self, line: InputLine) -> DispatchQueue | None:
        """The pool whose free slots pace `line` (its model's, with a headroom set), else None."""
        return self.pool_of(line) if self.deps.config.interactive_headroom else None

    async def until_seated(self, line: InputLine, task: asyncio.Task[None]) -> None:
        """With a headroom, the next line is judged once this one holds its slot (or ended, or a moment passed):
        lines still in admission hold none yet, and would all see the same free slots."""
        pool = self.headroom_pool(line)
        if pool is None:
            return
        free = pool.free_slots
        for _ in range(_SEATING_CHECKS):
            if pool.free_slots < free or task.done():
                return
            await asyncio.sleep(_SEATING_S)

    async def may_start(self, line: InputLine, running: set[asyncio.Task[None]]) -> bool:
        """Whether `line` may start now; waits while interactive requests queue, while its pool has no more free
        slots than the headroom kept for interactive arrivals, or while interactive requests are in flight there and
        `concurrency_beside_interactive` lines of this batch already run."""
        config, own, headroom = self.deps.config, self.pool_of(line), self.headroom_pool(line)
        while True:
            if self.closing or await self.stopped():
                return False
            interactive_waits = any(q.waiting_before(PRIORITY_BATCH) for q in self.deps.queues.values())
            beside = own is not None and own.in_use_before(PRIORITY_BATCH) > 0
            crowded = beside and len(running) >= config.concurrency_beside_interactive
            kept = headroom is None or headroom.free_slots > config.interactive_headroom
            if not interactive_waits and not crowded and kept:
                return True
            await asyncio.sleep(_PACING_S)

    async def stopped(self) -> bool:
        if self.stop is None and self.now() >= self.batch.expires_at:
            self.stop = "batch_expired"
        now = time.monotonic()
        if self.stop is None and now - self._checked_at >= _STATUS_CHECK_S:
            self._checked_at = now
            current = await asyncio.to_thread(self.deps.store.get_batch, None, self.batch.id)
            if current is None or current.status == "cancelling":
                self.stop = "batch_cancelled"
        return self.stop is not None

    async def run_line(self, line: InputLine) -> None:
        batch = self.batch
        answer = await self.answer(line)
        if answer.error_code == "budget_exhausted" and self.stop is None:
            self.stop = "budget_exhausted"  # the next lines would be refused too: the batch stops here
        row = LineRow(line.number, line.custom_id, self.request_id(line), "done", answer.status_code,
                      answer.body.decode(), answer.error_code)  # fmt: skip
        await asyncio.shield(asyncio.to_thread(self.deps.store.end_lines, batch.id, [row]))
        self.deps.metrics.batch_lines.labels("completed" if answered_ok(row) else "failed").inc()

    async def answer(self, line: InputLine) -> LineAnswer:
        """The line's answer; a transient refusal is retried (each try is a request with its own event) until the
        batch stops, when the last refusal is its answer."""
        for attempt in itertools.count():
            principal = await self.principal()
            if isinstance(principal, APIError):
                return LineAnswer(principal.status, _error_json(principal), principal.code)
            answer = await self.deps.caller.call(line, PATH_KINDS[self.batch.endpoint], principal, self.batch.id)
            if not answer.transient or self.closing or await self.stopped():
                return answer
            await asyncio.sleep(answer.retry_after_s or min(_RETRY_MAX_S, _RETRY_FIRST_S * 2**attempt))
        raise AssertionError("unreachable")

    async def principal(self) -> Principal | APIError:
        """The key that created the batch, as it stands now: a key revoked or a team disabled since stops its lines."""
        store, batch = self.deps.store, self.batch
        key, team = await asyncio.gather(
            asyncio.to_thread(store.get_key, batch.key_id), asyncio.to_thread(store.get_team, batch.team_id)
        )
        if key is None or key.revoked_at is not None or key.is_expired():
            return APIError(401, "The API key that created this batch was revoked or expired.", "invalid_api_key")
        if team is None or not team.enabled:
            return APIError(403, "The batch's team is disabled; ask your gateway admin.", "team_disabled")
        return Principal(key=key, team=team)

    async def end_unanswered(self, rows: list[LineRow], code: str) -> None:
        if not rows:
            return
        ended = [LineRow(r.line, r.custom_id, r.request_id, "done", error_code=code) for r in rows]
        await asyncio.to_thread(self.deps.store.end_lines, self.batch.id, ended)
        self.deps.metrics.batch_lines.labels(code).inc(len(ended))

    async def finalize(self) -> None:
        store, batch = self.deps.store, self.batch
        await asyncio.to_thread(store.update_batch, batch.id, status="finalizing", finalizing_at=self.now())
        rows = await asyncio.to_thread(store.batch_lines, batch.id)
        output, errors = output_files(batch.id, rows)
        status = _FINAL_STATUS.get(self.stop or "", "completed")
        out, err = self.file(output, "output"), self.file(errors, "error")
        await asyncio.to_thread(store.finish_batch, batch.id, status, self.now(), out, err)
        log.info("batch_ended", batch=batch.id, status=status, lines=len(rows))

    def file(self, content: str, name: str) -> StoredFile | None:
        """The batch's output or error file (None where it has no line), its team's like the batch."""
        if not content:
            return None
        batch, size = self.batch, len(content.encode())
        record = FileRecord(new_file_id(), batch.team_id, "batch_output", f"{batch.id}_{name}.jsonl", size, self.now())
        return record, content

    def request_id(self, line: InputLine) -> str:
        return line_request_id(self.batch.id, line.number)

    def now(self) -> int:
        return int(self.deps.clock())


def _unanswered(batch_id: str, line: InputLine) -> LineRow:  # a line never run, its reason set by end_unanswered
    return LineRow(line.number, line.custom_id, line_request_id(batch_id, line.number), "done")


def _error_json(err: APIError) -> bytes:
    return orjson.dumps(err.body())


def new_file_id() -> str:
    return "file-" + random_hex()[:24]
