"""Tasks that must run to their end although the request that started them is cancelled: a request's settle, a state
call whose result must be given back (gateway/request/settle.py `Settler.take`).

One `BackgroundTasks` per app, created by its lifespan (gateway/app.py) and kept in its `Services`; shutdown
waits for it, so that requests cut by the server's grace timeout still abort, settle and write their event before
usage and events are flushed (uvicorn cancels the handler tasks and goes straight on to the lifespan's exit).

Work starts eagerly (`start`): its first step runs at once, in the caller's task, as Python 3.12's eager tasks do.
Work that never suspends (an in-memory state call, a settle whose event line is written at once) is then done before
anything could cancel it, and costs no task and no trip through the event loop; only work that suspends becomes a
task, which carries on from where the first step stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar, cast

T = TypeVar("T")


class Done:
    """Work that finished in its first step, with its result."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def start(work: Coroutine[Any, Any, T]) -> Done | asyncio.Task[T]:
    """Run `work`'s first step now: `Done` if that finished it (its exception, if any, raises here), else a task
    that goes on with it."""
    try:
        yielded = work.send(None)
    except StopIteration as stop:
        return Done(stop.value)
    return asyncio.ensure_future(_resume(work, yielded))


class _Yield:
    """Yields what the suspended coroutine yielded (a future it waits on, or None), to the task now running it."""

    __slots__ = ("yielded",)

    def __init__(self, yielded: Any) -> None:
        self.yielded = yielded

    def __await__(self) -> Generator[Any, Any, Any]:
        return (yield self.yielded)


async def _resume(work: Coroutine[Any, Any, T], yielded: Any) -> T:
    """Drive `work` from its first suspension on, as a task drives a coroutine: each thing it yields is waited on
    by this task, then `work` is resumed; a cancel or an exception thrown into this task is thrown into `work`."""
    while True:
        try:
            value = await _Yield(yielded)
        except BaseException as e:  # noqa: BLE001 - whatever the task was sent, the work receives
            try:
                yielded = work.throw(e)
            except StopIteration as stop:
                return cast(T, stop.value)
            continue
        try:
            yielded = work.send(value)
        except StopIteration as stop:
            return cast(T, stop.value)


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A task that shutdown waits for (`wait`)."""
        return self._keep(asyncio.ensure_future(work))

    def start(self, work: Coroutine[Any, Any, T]) -> Done | asyncio.Task[T]:
        """`start(work)`; a task it became is one that shutdown waits for."""
        started = start(work)
        return started if isinstance(started, Done) else self._keep(started)

    def _keep(self, task: asyncio.Task[T]) -> asyncio.Task[T]:
        self._tasks.add(task)  # a strong reference until it ends, so a cancelled caller cannot orphan it to the GC
        task.add_done_callback(self._tasks.discard)
        return task

    async def shielded(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` to completion even if the caller is cancelled meanwhile (the caller still sees the cancel)."""
        started = self.start(work)
        if isinstance(started, Done):
            return cast(T, started.value)
        return await asyncio.shield(started)

    async def wait(self, timeout_s: float = 10.0) -> None:
        """Shutdown: let what the cancelled requests started finish (at most `timeout_s`)."""
        for _ in range(3):
            await asyncio.sleep(0)  # handlers cancelled just now reach their `finally` and start settling
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
