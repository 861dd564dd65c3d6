"""JSONL request events: exactly one line per request, written after settle, to a size-rotated file.

`emit()` only serialises and appends to an in-memory buffer (cheap, on the event loop); a background task hands
the buffer to a thread that appends it to the file, rotating `events.jsonl -> .1 -> .2 ...` past `max_bytes`.
`close()` (app shutdown, SIGTERM) writes whatever is left.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import orjson

# The event's fields, in order (DESIGN.md). Every line has all of them; unknown ones are left null.
FIELDS = (
    "ts",
    "request_id",
    "team",
    "key_id",
    "model",
    "route",
    "upstream_request_id",
    "instance",
    "priority",
    "status",
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
)


class EventWriter:
    def __init__(self, path: str | Path, max_bytes: int = 64 << 20, backups: int = 5, flush_interval_s=0.5):
        self.path = Path(path)
        self.max_bytes, self.backups, self.flush_interval_s = max_bytes, backups, flush_interval_s
        self._buf: list[bytes] = []
        self._lock = threading.Lock()  # one writer thread at a time (periodic flush vs close)
        self._task: asyncio.Task | None = None
        self.written = 0  # lines written to disk, for tests and /metrics

    def emit(self, event: dict) -> None:
        line = {k: event.get(k) for k in FIELDS}
        if line["ts"] is None:
            line["ts"] = time.time()
        self._buf.append(orjson.dumps(line) + b"\n")

    @property
    def pending(self) -> int:
        return len(self._buf)

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._flush_forever())

    async def flush(self) -> None:
        if self._buf:
            chunk, self._buf = self._buf, []
            await asyncio.to_thread(self._write, chunk)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.flush()

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            await self.flush()

    def _write(self, chunk: list[bytes]) -> None:
        with self._lock:
            size = self.path.stat().st_size if self.path.exists() else 0
            start = 0
            # Rotate between lines, not between flushes: a burst must not grow one file past max_bytes.
            for end, line in enumerate(chunk):
                if size and size + len(line) > self.max_bytes:
                    self._append(chunk[start:end])
                    self._rotate()
                    start, size = end, 0
                size += len(line)
            self._append(chunk[start:])
            self.written += len(chunk)

    def _append(self, lines: list[bytes]) -> None:
        if lines:
            with open(self.path, "ab") as f:
                f.write(b"".join(lines))

    def _rotate(self) -> None:
        if self.backups <= 0:
            self.path.unlink(missing_ok=True)
            return
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))


def read_events(path: str | Path) -> list[dict]:
    """All events in the current file (tests, tools)."""
    p = Path(path)
    if not p.exists():
        return []
    return [orjson.loads(line) for line in p.read_bytes().splitlines() if line.strip()]
