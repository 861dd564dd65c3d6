"""State changes the shared backend could not take yet: a settle or a slot release while Redis was away.

`put()` keeps the change in memory and appends it to a file at once (so a restart still has it); a background task
replays pending changes with exponential backoff until the backend takes them, then marks them done in the file.
Replays are idempotent on the backend (a settle stops at its tombstone, a release of a gone lease removes nothing),
so a change replayed twice, by a crash between its success and its done mark, bills once. A line the start cannot
replay (torn by a crash, or of another shape) is set aside in `<file>.quarantine` (gateway/accounting/quarantine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import orjson

from tokenweir.gateway.accounting.quarantine import NUMBER, Fields, read_lines, wrong_field
from tokenweir.gateway.state.backend import StateUnavailable

log = logging.getLogger("tokenweir.outbox")


# The changes an outbox line may hold, and what replaying each reads (gateway/state/redis.py `replay`).
_OPS: dict[str, Fields] = {
    "release_slot": {"team_id": (str,), "lease_id": (str,), "key_id": (str, None)},
    "settle": {
        "team_id": (str,),
        "res_id": (str,),
        "tokens": (int,),
        "now": NUMBER,
        "key_id": (str, None),
        "cost": (*NUMBER, None),
        "release": (dict, None),
    },
}


def _unusable(line: Any) -> str | None:
    """Why a decoded outbox line cannot be replayed (gateway/accounting/quarantine.py); None when it can."""
    if isinstance(line, dict) and "done" in line:
        return wrong_field(line, {"done": (str,)})
    why = wrong_field(line, {"id": (str,), "op": (dict,)}) or wrong_field(line["op"], {"op": (str,)})
    if why is not None:
        return why
    op = line["op"]
    if op["op"] not in _OPS:
        return f"an unknown change {op['op']!r}"
    why = wrong_field(op, _OPS[op["op"]])
    if why is None and op.get("release") is not None:
        why = wrong_field(op["release"], {"lease_id": (str,), "key_id": (str, None)})
    return why


class StateOutbox:
    def __init__(self, state, path: str | Path, max_backoff_s: float = 5.0) -> None:
        self.state, self.path, self.max_backoff_s = state, Path(path), max_backoff_s
        self._pending: dict[str, dict] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.delivered = 0

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, op: dict) -> None:
        """Keep a change for later (sync: called from a settling `finally`)."""
        op_id = uuid.uuid4().hex
        self._pending[op_id] = op
        self._append({"id": op_id, "op": op})
        self._wake.set()

    async def start(self) -> None:
        """Load what an earlier run left undelivered, compact the file, and start replaying."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            done: set[str] = set()
            for line in read_lines(self.path, _unusable):  # one torn by a crash, or of another shape: set aside
                if "done" in line:
                    done.add(line["done"])
                else:
                    self._pending[line["id"]] = line["op"]
            for op_id in done:
                self._pending.pop(op_id, None)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(b"".join(orjson.dumps({"id": k, "op": v}) + b"\n" for k, v in self._pending.items()))
            os.replace(tmp, self.path)
            if self._pending:
                log.warning("state outbox: %d changes left by an earlier run, replaying", len(self._pending))
        self._task = asyncio.create_task(self._run(), name="state-outbox")
        self._wake.set()

    async def drain(self) -> bool:
        """Try every pending change once; True when none is left."""
        for op_id, op in list(self._pending.items()):
            try:
                await self.state.replay(op)
            except StateUnavailable:
                return False
            except Exception:  # noqa: BLE001 - the replay loop must outlive anything one change raises
                log.exception("state outbox: replaying %s failed; will retry", op.get("op"))
                return False
            self._pending.pop(op_id, None)
            self._append({"done": op_id})
            self.delivered += 1
        return not self._pending

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            await self._wake.wait()
            self._wake.clear()
            while not await self.drain():
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
            backoff = 0.05
            if not self._pending:
                with contextlib.suppress(OSError):
                    self.path.write_bytes(b"")  # everything delivered: start the file afresh

    async def close(self, timeout_s: float = 2.0) -> None:
        """Stop replaying after a last bounded try; what is still pending stays in the file for the next start."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.drain()
        if self._pending:
            log.warning("state outbox: %d changes not delivered; kept in %s for the next start", len(self), self.path)

    def _append(self, line: dict) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, orjson.dumps(line) + b"\n")
            finally:
                os.close(fd)
        except OSError:
            log.exception("state outbox: cannot write %s; the change is kept in memory only", self.path)
