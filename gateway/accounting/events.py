"""JSONL request events: exactly one line per request, written after settle, to a size-rotated file.

The event log is the write-ahead record of usage. `emit()` appends the line to the file at once (one `write` on
an O_APPEND descriptor, microseconds), so a process killed a moment later has already put it in the OS's hands;
a background task fsyncs every `flush_interval_s`, bounding what a power loss could take. Each line carries a
`seq`, increasing per writer: usage rows in the store record the last seq they include, and start-up replays
the events after it (`replay_after`), so a crash between an event and the next usage flush loses no bill.
The file rotates `events.jsonl -> .1 -> .2 ...` past `max_bytes`, always between lines.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson

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
    "reason",  # why it is not ok; on an ok stream, "output_cut": its upstream went past max_tokens and was cut there
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
    "kind",  # chat | completions | embeddings (gateway/openai/endpoints.py: each with its path)
    "upstream_error",  # why the last hop that failed did, its address included (never in the tenant's answer)
    "overrun_tokens",  # completion tokens beyond the output reserved (max_tokens): made, billed, not admitted
    # upstream | engine_abort | estimate_text | reservation_bound (gateway/request/settle.py); null: no hop
    "usage_source",
    "seq",
)


class EventWriter:
    def __init__(self, path: str | Path, max_bytes: int = 64 << 20, backups: int = 5, flush_interval_s=0.5):
        self.path = Path(path)
        self.max_bytes, self.backups, self.flush_interval_s = max_bytes, backups, flush_interval_s
        self._lock = threading.Lock()  # emit (event loop) vs fsync (a thread)
        self._fd: int | None = None
        self._size = 0
        self._dirty = False
        self._task: asyncio.Task | None = None
        self.seq = 0  # of the last line written
        self.written = 0  # lines written since start, for tests and /metrics

    def open(self, after_seq: int = 0) -> None:
        """Open for appending; seqs continue after `after_seq` and after every line already in the files."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seq = max(after_seq, last_seq(self.path, self.backups))
        self._reopen()

    def emit(self, event: dict) -> int:
        """Write one event line now; returns its seq."""
        line = {k: event.get(k) for k in FIELDS}
        if line["ts"] is None:
            line["ts"] = time.time()
        with self._lock:
            if self._fd is None:
                self.open()
            self.seq += 1
            line["seq"] = self.seq
            data = orjson.dumps(line) + b"\n"
            if self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
            assert self._fd is not None  # opened above if it was not; a rotation reopens it
            os.write(self._fd, data)
            self._size += len(data)
            self._dirty = True
            self.written += 1
            return self.seq

    async def start(self) -> None:
        if self._fd is None:
            self.open()
        self._task = asyncio.create_task(self._sync_forever())

    async def flush(self) -> None:
        """fsync what was written (the lines are in the file already)."""
        await asyncio.to_thread(self._fsync)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._fsync()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    async def _sync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            await self.flush()

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
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size

    def _rotate(self) -> None:
        assert self._fd is not None  # emit rotates the file it has open
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


def _files_oldest_first(path: Path, backups: int) -> list[Path]:
    files = [path.with_name(f"{path.name}.{i}") for i in range(backups, 0, -1)] + [path]
    return [f for f in files if f.exists()]


def _lines(path: Path) -> Iterator[dict]:
    for raw in path.read_bytes().splitlines():
        if raw.strip():
            try:
                yield orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue  # a line torn by a crash mid-write carries no complete bill: skip it


def last_seq(path: str | Path, backups: int = 5) -> int:
    """The highest seq in the newest non-empty file (0 for none)."""
    for f in reversed(_files_oldest_first(Path(path), backups)):
        seqs = [e.get("seq") or 0 for e in _lines(f)]
        if seqs:
            return max(seqs)
    return 0


def replay_after(path: str | Path, seq: int, backups: int = 5) -> Iterator[dict]:
    """Events with a seq above `seq`, oldest first (start-up: those whose usage may not be in the store)."""
    needed = []
    # Newest file first, until one starts at or below `seq`: older files cannot hold anything later.
    for f in reversed(_files_oldest_first(Path(path), backups)):
        needed.append(f)
        first = next(_lines(f), None)
        if first is not None and (first.get("seq") or 0) <= seq:
            break
    for f in reversed(needed):
        for event in _lines(f):
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
