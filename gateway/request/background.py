"""Tasks that must run to their end although the request that started them is cancelled: a request's settle, a state
call whose result must be given back (gateway/request/settle.py `Settler.take`).

One `BackgroundTasks` per app, created by its lifespan (gateway/server/app.py) and kept in its `Services`; shutdown
waits for it, so that requests cut by the server's grace timeout still abort, settle and write their event before
usage and events are flushed (uvicorn cancels the handler tasks and goes straight on to the lifespan's exit).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, work: Awaitable[T]) -> asyncio.Task[T]:
        """A task that shutdown waits for (`wait`)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)  # a strong reference until it ends, so a cancelled caller cannot orphan it to the GC
        task.add_done_callback(self._tasks.discard)
        return task

    async def shielded(self, work: Awaitable[T]) -> T:
        """Run `work` to completion even if the caller is cancelled meanwhile (the caller still sees the cancel)."""
        return await asyncio.shield(self.spawn(work))

    async def wait(self, timeout_s: float = 10.0) -> None:
        """Shutdown: let what the cancelled requests started finish (at most `timeout_s`)."""
        for _ in range(3):
            await asyncio.sleep(0)  # handlers cancelled just now reach their `finally` and start settling
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
