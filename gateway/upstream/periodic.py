"""A step run every few seconds in a task of its own, for as long as the app runs (routing refresh, rollout
judgement, the shared prefix index): a failure its owner names as passing (the store away) is logged and the step is
simply tried again next time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tokenweir.common.logging import get_logger

log = get_logger()


class Periodic:
    def __init__(
        self,
        step: Callable[[], Awaitable[object]],
        failure_event: str,
        passing: tuple[type[Exception], ...] = (),
    ) -> None:
        self.step, self.failure_event, self.passing = step, failure_event, passing
        self._task: asyncio.Task | None = None

    def start(self, interval_s: float) -> None:
        self._task = asyncio.create_task(self._run(interval_s))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self, interval_s: float) -> None:
        while True:
            try:
                await self.step()
            except self.passing as exc:  # e.g. the store away: what this replica has stands until it answers
                log.warning(self.failure_event, error=type(exc).__name__)
            await asyncio.sleep(interval_s)
