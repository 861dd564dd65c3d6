"""When the event log cannot take a line (a full disk: ENOSPC, an I/O error): what failed, which lines of a failed
write still landed whole, how the writer learns that it has room again, and the refusal answered meanwhile.

The event log is the write-ahead record of usage (gateway/accounting/events.py), so an answer must not go out as billed
while it cannot be written. An EventWriter's `faults.fault` is set by the first failed write and cleared by the next
write that succeeds, or by its probe (`probe_room`, every flush interval while failing) finding room; meanwhile
admission refuses new requests (`unavailable`: 503 `events_unavailable` with Retry-After), /health is unready and
names the log, and /metrics and the log say why. The requests already running when it failed bill straight to the
store instead (gateway/request/billing.py); one whose bill reaches neither is refused the same way if its answer is
not sent yet.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tokenweir.common.http.errors import APIError
from tokenweir.common.logging import get_logger

log = get_logger()

# What the probe writes beside the log to call it writable again: room for ~90 event lines.
PROBE_BYTES = 64 << 10


@dataclass(slots=True, frozen=True)
class EventsFault:
    """Why the event log cannot take lines, and since when."""

    error: str  # "ENOSPC: No space left on device"
    since: float  # time.time() of the first failed write


class WriteFaults:
    """An EventWriter's faults: the one it is in (None: writable), its failed writes by errno name since start (for
    /metrics), and the log lines of each change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fault: EventsFault | None = None
        self.failed_writes: dict[str, int] = {}

    def failed(self, e: OSError) -> None:
        name = errno.errorcode.get(e.errno or 0, "other")
        self.failed_writes[name] = self.failed_writes.get(name, 0) + 1
        if self.fault is None:
            self.fault = EventsFault(f"{name}: {e.strerror or e}", time.time())
            log.error("events_unwritable", path=str(self.path), error=self.fault.error, refusing="events_unavailable")

    def recovered(self, by: str) -> None:
        assert self.fault is not None
        after_s = round(time.time() - self.fault.since, 3)
        log.warning("events_writable_again", path=str(self.path), by=by, after_s=after_s)
        self.fault = None

    async def probe(self) -> None:
        """Whether the log's disk has room: a probe file beside it (`probe_room`). Clears the fault if it has; if it
        has not, the writer is failing from now on (a disk full at start)."""
        try:
            await asyncio.to_thread(probe_room, self.path)
        except OSError as e:
            if self.fault is None:
                self.failed(e)
            return
        if self.fault is not None:
            self.recovered("the probe")


def landed(lines: list[bytes], done: int) -> tuple[int, int]:
    """Of `lines` written as one buffer that stopped after `done` bytes: how many landed whole, and the bytes of the
    next one's fragment left at the end of the file (0: the write stopped between lines)."""
    whole = 0
    for line in lines:
        if done < len(line):
            return whole, max(done, 0)
        done -= len(line)
        whole += 1
    return whole, 0


def probe_room(path: Path, nbytes: int = PROBE_BYTES) -> None:
    """Write `nbytes` to a file beside the log, sync and remove it: raises the OSError of a disk still full or
    failing. (Blocking: run it in a thread.)"""
    probe = path.with_name(path.name + ".probe")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = b"\n" * nbytes
        done = 0
        while done < nbytes:
            done += os.write(fd, data[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def unavailable(retry_after_s: int, answered: bool = False) -> APIError:
    """The refusal while the event log cannot record usage: of a new request, or (`answered`) of one whose answer
    the upstream made but whose bill reached neither the event log nor the store."""
    if answered:
        message = "The gateway could not record this request's usage, so its answer is not given"
    else:
        message = "The gateway cannot record usage now (its event log cannot be written)"
    return APIError(
        503, f"{message}; retry in {retry_after_s}s.", "events_unavailable", headers={"retry-after": str(retry_after_s)}
    )
