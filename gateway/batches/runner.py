"""Each replica's batch runner: it finds the batches no live replica runs, takes each one's lease in the store and
runs it (gateway/batches/job.py), renewing the lease every `lease_s / 3` while it runs. A replica that dies stops
renewing: its batches' leases lapse `lease_s` later and another replica takes them over, resuming each where its
rows say it stopped. The lease's owner is the replica's writer id (unique per gateway process, the same across its
restarts), so a restarted replica takes its own batches back at once instead of waiting for their leases to lapse.

A lease lost while the job runs (the store unreachable past the lease, another replica took it) cancels the job here:
a batch is run by one replica at a time. On shutdown the jobs stop starting lines, their running lines end within
the grace, and their leases are given back so that another replica resumes them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools

from tokenweir.common.logging import get_logger
from tokenweir.gateway.batches.job import BatchJob, JobDeps
from tokenweir.gateway.store.db import DB_ERRORS

log = get_logger()


class BatchRunner:
    def __init__(self, deps: JobDeps, owner: str, grace_s: float) -> None:
        self.deps, self.owner, self.grace_s = deps, owner, grace_s
        self.jobs: dict[str, tuple[BatchJob, asyncio.Task[None]]] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop = asyncio.create_task(self.run())

    def wake(self) -> None:
        """A batch was created or cancelled here: look now rather than at the next poll."""
        self._wake.set()

    async def run(self) -> None:
        config = self.deps.config
        every = min(config.poll_interval_s, config.lease_s / 3)
        while True:
            try:
                await self.renew()
                await self.claim()
            except DB_ERRORS as e:  # the store away: the leases lapse if it stays away, and the jobs stop
                log.warning("batch_runner_store_error", error=f"{type(e).__name__}: {e}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), every)
            self._wake.clear()

    async def claim(self) -> None:
        store, now = self.deps.store, self.deps.clock()
        for batch_id in await asyncio.to_thread(store.claimable_batches, self.owner, now):
            if batch_id in self.jobs:
                continue
            until = now + self.deps.config.lease_s
            if not await asyncio.to_thread(store.claim_batch, batch_id, self.owner, now, until):
                continue  # another replica was first
            batch = await asyncio.to_thread(store.get_batch, None, batch_id)
            if batch is None:
                continue
            job = BatchJob(batch, self.deps)
            task = asyncio.create_task(job.run())
            self.jobs[batch_id] = (job, task)
            task.add_done_callback(functools.partial(self._ended, batch_id))
            log.info("batch_claimed", batch=batch_id, status=batch.status, owner=self.owner)

    def _ended(self, batch_id: str, task: asyncio.Task[None]) -> None:
        self.jobs.pop(batch_id, None)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("batch_job_failed", batch=batch_id, error=f"{type(error).__name__}: {error}")
            # its lease is still ours: the next poll resumes it (not at once: a job that fails alike would spin)

    async def renew(self) -> None:
        now = self.deps.clock()
        until = now + self.deps.config.lease_s
        for batch_id, (_, task) in list(self.jobs.items()):
            if not await asyncio.to_thread(self.deps.store.claim_batch, batch_id, self.owner, now, until):
                log.warning("batch_lease_lost", batch=batch_id, owner=self.owner)
                task.cancel()

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        jobs = list(self.jobs.values())
        for job, _ in jobs:
            job.closing = True
        tasks = [task for _, task in jobs]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for job, _ in jobs:
            with contextlib.suppress(*DB_ERRORS):
                await asyncio.to_thread(self.deps.store.release_batch, job.batch.id, self.owner)
