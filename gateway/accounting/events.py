"""JSONL request events: exactly one line per request, written after settle, to a size-rotated file.

The event log is the write-ahead record of usage. A request's line is in the OS's hands (a `write` on an O_APPEND
descriptor) before its answer is completed, so a process killed a moment later has lost no bill; a background task
fsyncs every `flush_interval_s`, bounding what a power loss could take. Each line carries a `seq`, increasing per
writer and in file order: usage rows in the store record the last seq they include, and start-up replays the events
after it (`replay_after`), so a crash between an event and the next usage flush loses no bill (a line it cannot
read is set aside: gateway/accounting/event_lines.py). The file rotates `events.jsonl -> .1 -> .2 ...` past
`max_bytes`, always between lines.

Group commit: `await commit(event)` returns the line's seq once the line is written. The first line of a loop
iteration is written at once (a request alone waits for nothing: no timer, no waiting for company) and opens a
batch: the lines committed after it in the same iteration join the batch, written with one `write` by a callback
queued (`call_soon`) at the end of that iteration, and their commits return then. `emit(event)` is the synchronous
form, for the rare caller that cannot await (a request refused before admission): it writes at once, the open batch
before its own line, so seqs stay in file order.

A write that fails (a full disk, an I/O error) leaves the writer failing (`faults`, gateway/accounting/event_faults.py):
the lines of the batch that landed whole before the error are committed, the rest raise to their committers (whose
bills then go to the store directly), a fragment it left is ended before the next line, and admission refuses new
requests until a write succeeds again or the probe of the sync task finds room.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson

from tokenweir.gateway.accounting.event_faults import WriteFaults, landed
from tokenweir.gateway.accounting.event_lines import event_lines

# The event's fields, in order. Every line has all of them; unknown ones are left null.
FIELDS = (
    "ts",
    "request_id",
    "team",
    "key_id",
    "model",
    "route",
    "route_reason",
    "upstream_request_id",
    "instance",
    "priority",
    "status",
    # why it is not ok (e.g. queue_timeout, ttft_timeout: no first token in time, total_timeout: no whole answer in
    # time, client_disconnected, upstream_broken); on an ok stream, "output_cut": its upstream went past max_tokens
    "reason",
    "http_status",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "max_tokens",
    "queue_ms",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "finish_reason",
    "stream",
    "client_disconnected",
    "served_model",  # the pool whose hop served it (a fallback's name after failover): usage is kept under it
    "user",  # the request's `user` field (the client's end user), clipped like every client string
    "cost",  # USD at the serving pool's prices (config price_*_per_1m); null when the pool has none
    "kind",  # chat | completions | embeddings | responses (gateway/openai/endpoints.py: each with its path)
    "upstream_error",  # why the last hop that failed did, its address included (never in the tenant's answer)
    "overrun_tokens",  # completion tokens beyond the output reserved (max_tokens): made, billed, not admitted
    # upstream | engine_abort | estimate_text | reservation_bound (gateway/request/settle.py); null: no hop
    "usage_source",
    # speculative decoding on the serving engine (its usage's completion_tokens_details): drafts it checked, and the
    # share of them it kept; null where it reported none
    "draft_tokens",
    "draft_acceptance",
    # disaggregated prefill: the prefill member that computed the prompt (its KV fetched by `instance`), and its
    # hop's milliseconds (inside ttft_ms); null where the request took one hop
    "prefill_instance",
    "prefill_ms",
    # a request for an alias (weighted variants): the name asked for and the variant it got (`model` is its pool)
    "alias",
    "variant",
    "variant_steered",  # the variant was picked by the x-tokenweir-variant header (not judged by a rollout)
    # the model version the serving instance runs: its configured `revision`, else its engine's model-file digest
    "model_revision",
    # and what the decode member's answer says it fetched from it: prompt tokens (0: its own prefix cache held them,
    # or the fetch failed and it computed them), bytes, milliseconds
    "kv_fetched_tokens",
    "kv_fetched_bytes",
    "kv_fetch_ms",
    # the request's OpenTelemetry trace (32 hex characters, the client's own where it sent a traceparent); null
    # with tracing off (config `tracing`)
    "trace_id",
    "batch_id",  # a batch line's batch (/v1/batches, gateway/batches/); null for every other request
    "seq",
)


class EventWriter:
    """The event file of one process. Lines are written on the event loop, not in a thread: measured here (Python
    3.11, page cache), one `write` of a batch costs ~2 us of CPU for one line and ~20 us for 32 lines of ~700 bytes,
    while handing it to a thread (`asyncio.to_thread`) costs ~45-70 us of CPU and ~100-130 us of wall time per
    batch: the hand-off would cost more than the write it takes off the loop, and the CPU per request is what the
    gateway's budget counts. Every call but the fsync is made from the loop's thread; the lock keeps the fsync
    thread off a descriptor that a rotation closes.

    Measured in a micro A/B (the same lines, requests finishing over a few loop iterations, one write per line vs
    this): at 32 concurrent requests ~2.7 lines per write for the same CPU per request (within 1 us); alone, ~1 us
    more (the queued callback). A line's write costs ~1-2 us: group commit saves syscalls and file-lock hand-offs,
    not CPU that can be measured at this size of line."""

    def __init__(self, path: str | Path, max_bytes: int = 64 << 20, backups: int = 5, flush_interval_s=0.5):
        self.path = Path(path)
        self.max_bytes, self.backups, self.flush_interval_s = max_bytes, backups, flush_interval_s
        self._lock = threading.Lock()  # writes and rotation (event loop) vs fsync (a thread)
        self._fd: int | None = None
        self._size = 0
        self._dirty = False
        self._task: asyncio.Task | None = None
        self._batch: list[bytes] = []  # the open batch's lines, in seq order (written at the iteration's end)
        self._waiters: list[asyncio.Future[None]] = []  # one per commit in the open batch: each caller's own, so
        # that a caller cancelled while it waits cancels nobody else's wait
        # The loop on which a callback that writes the open batch is queued (a loop, not a flag: one that stopped
        # before running it must not keep a later loop's commits from scheduling their own)
        self._scheduled_on: asyncio.AbstractEventLoop | None = None
        self.seq = 0  # of the last line put in a batch
        self.written = 0  # lines written since start, for tests and /metrics
        self.writes = 0  # batches written (a `write` each, two across a rotation): written / writes = batch size
        self.faults = WriteFaults(self.path)  # why the last write failed, until one succeeds or the probe finds room
        self.retry_after_s = max(1, round(2 * flush_interval_s))  # what a refusal while failing says (it probes so)
        self._torn = False  # the file ends in a fragment (a failed write, a kill): ended before the next line
        self._landed = 0  # lines of the batch being written that are in the file whole

    def open(self, after_seq: int = 0) -> None:
        """Open for appending; seqs continue after `after_seq` and after every line already in the files."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seq = max(after_seq, last_seq(self.path, self.backups))
        self._reopen()
        # A batch torn by a kill mid-write: its fragment is ended before the next line, so that the line is not glued
        # onto it (the reader skips the fragment; a glued line would be skipped with it, and its bill lost).
        self._torn = bool(self._size) and not _ends_a_line(self.path)

    async def commit(self, event: dict) -> int:
        """Write one event line, at once or with this loop iteration's batch; returns its seq once the line is
        written (in the OS's hands). A write that fails (a full disk) raises its OSError here, for every line of its
        batch that did not land whole. A caller cancelled while it waits stops waiting, but its line is written with
        the batch all the same."""
        seq = self._enqueue(event)
        loop = asyncio.get_running_loop()
        if self._scheduled_on is not loop:
            # The first line of this loop iteration: no batch is open, so it is a batch of one, written now (an idle
            # request waits for nothing); the lines that follow in this iteration share one write at its end.
            self._scheduled_on = loop
            loop.call_soon(self._write_scheduled)
            self._write_batch()
            return seq
        waiter = loop.create_future()
        self._waiters.append(waiter)
        await waiter
        return seq

    def emit(self, event: dict) -> int:
        """Write one event line now, after the open batch (for a caller that cannot await); returns its seq. A write
        that fails leaves the writer failing but does not raise: such a caller has no bill riding on its line."""
        seq = self._enqueue(event)
        self._write_batch_quietly()
        return seq

    async def start(self) -> None:
        if self._fd is None:
            self.open()
        await self.faults.probe()  # a disk already full at start is known before the first request
        self._task = asyncio.create_task(self._sync_forever())

    async def flush(self) -> None:
        """fsync what was committed (the open batch is written first, as the end of this iteration would)."""
        self._write_batch_quietly()
        await asyncio.to_thread(self._fsync)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._write_batch_quietly()
        try:
            self._fsync()
        except OSError as e:
            self.faults.failed(e)
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _enqueue(self, event: dict) -> int:
        line = {k: event.get(k) for k in FIELDS}
        if line["ts"] is None:
            line["ts"] = time.time()
        if self._fd is None:  # opened here, before a seq is given: opening reads the last seq of the files
            with self._lock:
                self.open()
        self.seq += 1
        line["seq"] = self.seq
        self._batch.append(orjson.dumps(line) + b"\n")
        return self.seq

    def _write_scheduled(self) -> None:
        self._scheduled_on = None
        self._write_batch_quietly()

    def _write_batch_quietly(self) -> None:
        with contextlib.suppress(Exception):  # raised to every committer of the batch, who logs it with its request
            self._write_batch()

    def _write_batch(self) -> None:
        """Write the open batch (one `write`, two across a rotation), then release its committers."""
        lines, waiters = self._batch, self._waiters
        if not lines:
            return
        self._batch, self._waiters = [], []
        self._landed = 0
        try:
            with self._lock:
                self._write_lines(lines)
        except Exception as e:
            # The first lines may have landed whole: committed. (A waiter's line is the waiter's index in the batch;
            # the caller that writes it, commit's first line or emit's, has the last line, which never landed.)
            for i, waiter in enumerate(waiters):
                if waiter.done():
                    continue
                if i < self._landed:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(e)
            if isinstance(e, OSError):
                self.faults.failed(e)
            raise
        if self.faults.fault is not None:
            self.faults.recovered("a write")
        for waiter in waiters:
            if not waiter.done():  # done: its caller was cancelled meanwhile
                waiter.set_result(None)

    def _write_lines(self, lines: list[bytes]) -> None:
        start, size = 0, self._size
        for i, data in enumerate(lines):
            if size and size + len(data) > self.max_bytes:  # rotate between lines, as one line at a time would
                if i > start:
                    self._write_out(lines[start:i])
                self._rotate()
                start, size = i, 0
            size += len(data)
        self._write_out(lines[start:])

    def _write_out(self, lines: list[bytes]) -> None:
        if self._fd is None:  # a rotation that could not open the new file
            self._reopen()
        assert self._fd is not None
        end = b"\n" if self._torn else b""  # ends the fragment a failed write (or a kill) left
        data = end + (lines[0] if len(lines) == 1 else b"".join(lines))
        self._dirty = True
        done = 0
        try:
            while done < len(data):  # a short write (a full disk, a signal): the rest, or the error that stopped it
                done += os.write(self._fd, data[done:])
        finally:
            self._size += done
            whole, fragment = landed(lines, done - len(end))
            self._torn = fragment > 0 or (done < len(end) and self._torn)
            self._landed += whole
            self.written += whole
        self.writes += 1

    async def _sync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            if self.faults.fault is not None:  # no request needs to try a write: admission refuses them meanwhile
                await self.faults.probe()
                continue
            try:
                await self.flush()
            except OSError as e:  # an fsync's I/O error: what the page cache held may not reach the disk
                self.faults.failed(e)

    def _fsync(self) -> None:
        with self._lock:
            if self._fd is None or not self._dirty:
                return
            self._dirty = False
            fd = os.dup(self._fd)  # fsync outside the lock; a rotation may close the original meanwhile
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _reopen(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None  # never left naming a closed descriptor, should the open below fail
            os.close(fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size
        self._torn = False  # a new file, or the one open() checks itself

    def _rotate(self) -> None:
        assert self._fd is not None  # a batch rotates the file it has open
        os.fsync(self._fd)
        if self.backups <= 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._reopen()


def _ends_a_line(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _files_oldest_first(path: Path, backups: int) -> list[Path]:
    files = [path.with_name(f"{path.name}.{i}") for i in range(backups, 0, -1)] + [path]
    return [f for f in files if f.exists()]


def last_seq(path: str | Path, backups: int = 5) -> int:
    """The highest seq in the newest non-empty file (0 for none)."""
    for f in reversed(_files_oldest_first(Path(path), backups)):
        seqs = [e.get("seq") or 0 for e in event_lines(f, Path(path))]
        if seqs:
            return max(seqs)
    return 0


def replay_after(path: str | Path, seq: int, backups: int = 5) -> Iterator[dict]:
    """Events with a seq above `seq`, oldest first (start-up: those whose usage may not be in the store)."""
    needed = []
    # Newest file first, until one starts at or below `seq`: older files cannot hold anything later.
    for f in reversed(_files_oldest_first(Path(path), backups)):
        needed.append(f)
        first = next(event_lines(f, Path(path)), None)
        if first is not None and (first.get("seq") or 0) <= seq:
            break
    for f in reversed(needed):
        for event in event_lines(f, Path(path)):
            if (event.get("seq") or 0) > seq:
                yield event


def read_events(path: str | Path) -> list[dict]:
    """All events in the current file (tests, tools)."""
    p = Path(path)
    if not p.exists():
        return []
    data = p.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # a line the writer is still appending has no newline yet: not an event
    return [orjson.loads(line) for line in complete.splitlines() if line.strip()]
