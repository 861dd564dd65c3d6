"""The dispatch queue: who may send a request to the engine pool next.

`capacity` dispatch slots are shared by all teams. A request takes a slot at once if one is free and nobody waits;
otherwise it waits as a future in its team's FIFO inside its priority band. When a slot frees, the lowest band with
waiters is served, and inside it the team that has had the least service for its weight (policies/priority.py),
counted in weighted tokens (`fairness: tokens`, VTC: a request's prompt tokens when it is let in, its output tokens
times `output_token_weight` when it ends, whether it queued or found a slot free) or in requests (`fairness:
requests`: each dispatch from the queue counts one), or not shared at all (`fairness: fcfs`: one FIFO for every
team of a band, first come first served, as vLLM's default). Each replica counts what it let in: with R replicas
sharing a pool evenly, the service difference between two backlogged teams stays within R times one queue's bound.

The number of waiters is bounded and each waiter has a deadline (`queue_timeout`). At the bound a request of a higher
band takes the place of the latest-arrived waiter of the lowest-priority band below its own
(policies/priority.py `pick_displaced`), which is shed at once with `displaced` (429 + Retry-After) and holds nothing
here; a request of the same or a lower band than every waiter is refused with `queue_full`. A waiter cancelled or
timed out while queued is removed; if a slot was handed to it in that same instant, the slot is passed on.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenweir.gateway.config import PoolConfig
from tokenweir.policies.decisions import Rejected
from tokenweir.policies.limits import PRIORITY_STANDARD
from tokenweir.policies.priority import StrideScheduler, band_of, pick_displaced
from tokenweir.policies.retry import queue_retry_after

K = TypeVar("K")  # a count's key: a team id, a band

_ids = itertools.count(1)


@dataclass(eq=False)
class Ticket:
    """A held dispatch slot. Give it back with `DispatchQueue.release` in a finally."""

    team_id: str
    priority: int
    enqueued_at: float  # time.monotonic()
    weight: int = 1  # the team's share
    flow: str = ""  # whose FIFO it waits in and whose share it counts against: its team's (one for all, with fcfs)
    units: int = 1  # the service its dispatch counts: one request, or its prompt tokens (fairness: tokens)
    granted_at: float = 0.0
    released: bool = False
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def queue_s(self) -> float:
        return max(0.0, self.granted_at - self.enqueued_at)


@dataclass(eq=False)
class _Waiter:
    ticket: Ticket
    future: asyncio.Future[Ticket | None]
    queued: bool = True
    shed: Rejected | None = None  # set when displaced: its future then resolves to None, never to a ticket


@dataclass
class _Band:
    scheduler: StrideScheduler = field(default_factory=StrideScheduler)
    waiters: dict[str, deque[_Waiter]] = field(default_factory=dict)  # flow -> FIFO (only non-empty ones)


class DispatchQueue:
    def __init__(
        self,
        capacity: int,
        max_queued: int,
        hold_estimate_s: float = 1.0,
        fairness: str = "tokens",
        output_token_weight: float = 2.0,
    ) -> None:
        assert capacity >= 0 and max_queued >= 0
        self.capacity = capacity
        self.max_queued = max_queued
        self.fairness, self.output_token_weight = fairness, output_token_weight
        self._in_use = 0
        self._queued = 0
        self._bands: dict[int, _Band] = {}
        self._in_use_by_team: dict[str, int] = {}
        self._in_use_by_band: dict[int, int] = {}
        self._queued_by_team: dict[str, int] = {}
        self._mean_hold_s = hold_estimate_s  # EWMA of how long a slot is held, for Retry-After
        self.dispatched = 0
        self.rejected_full = 0
        self.displaced = 0
        self.timed_out = 0
        self.cancelled = 0

    async def acquire(
        self, team_id: str, priority: int, weight: int = 1, timeout_s: float | None = None, prompt_tokens: int = 0
    ) -> Ticket:
        """Wait for a dispatch slot: Rejected('queue_full') at once, ('queue_timeout') at the deadline,
        ('displaced') when a request of a higher band takes this one's place in a full queue."""
        assert weight >= 1
        # clamp into the known bands: a client-chosen priority must not mint new bands (memory, O(bands) work)
        flow = "" if self.fairness == "fcfs" else team_id
        ticket = Ticket(team_id, band_of(priority, PRIORITY_STANDARD), time.monotonic(), weight, flow=flow)
        if self.fairness == "tokens":
            ticket.units = max(1, prompt_tokens)  # a request of no prompt (an empty embedding input) still costs
        if self._queued == 0 and self._in_use < self.capacity:
            self._grant(ticket)
            if self.fairness == "tokens":  # service is service, queued or not: the counter sees all of it
                self._bands.setdefault(ticket.priority, _Band()).scheduler.charge(flow, ticket.units, weight)
            return ticket
        if self._queued >= self.max_queued and not self._displace_for(ticket.priority):
            self.rejected_full += 1
            retry = queue_retry_after(self._queued, self.capacity, self._mean_hold_s)
            msg = (
                f"The server is at capacity: {self._queued} requests queued (limit {self.max_queued}). "
                f"Retry after {retry}s."
            )
            raise Rejected("queue_full", msg, retry)
        waiter = _Waiter(ticket, asyncio.get_running_loop().create_future())
        self._enqueue(waiter, weight)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter.future
        except BaseException as exc:
            if waiter.shed is not None:  # displaced in the instant its deadline or its client's leaving came
                if isinstance(exc, TimeoutError):
                    raise waiter.shed from None
                raise
            self._abandon(waiter)
            if isinstance(exc, TimeoutError):
                self.timed_out += 1
                retry = queue_retry_after(self._queued, self.capacity, self._mean_hold_s)
                msg = (
                    f"Timed out after {timeout_s:g}s waiting for capacity ({self._queued} requests queued). "
                    f"Retry after {retry}s."
                )
                raise Rejected("queue_timeout", msg, retry) from None
            self.cancelled += 1
            raise
        if waiter.shed is not None:
            raise waiter.shed
        return ticket

    def release(self, ticket: Ticket, output_tokens: int = 0) -> None:
        """Give a slot back and hand it to the next waiter; with fairness by tokens, its team is charged the
        `output_tokens` it made. Idempotent; never awaits (safe in any finally)."""
        if ticket.released:
            return
        if self.fairness == "tokens" and output_tokens > 0 and ticket.priority in self._bands:
            units = round(output_tokens * self.output_token_weight)
            self._bands[ticket.priority].scheduler.charge(ticket.flow, units, ticket.weight)
        self._free(ticket)
        held = time.monotonic() - ticket.granted_at
        self._mean_hold_s += 0.1 * (held - self._mean_hold_s)
        self._dispatch()

    def waiting_before(self, band: int) -> int:
        """Waiters of the bands served before `band` (a lower number): the batch runner starts a line only when
        none of the interactive bands waits (gateway/batches/job.py)."""
        return sum(len(fifo) for p, b in self._bands.items() if p < band for fifo in b.waiters.values())

    def in_use_before(self, band: int) -> int:
        """Slots held by requests of the bands served before `band`: interactive requests in flight, which the batch
        runner yields to (gateway/batches/job.py)."""
        return sum(n for p, n in self._in_use_by_band.items() if p < band)

    @property
    def free_slots(self) -> int:
        return max(0, self.capacity - self._in_use)

    def set_capacity(self, n: int) -> None:
        """Resize the pool. Shrinking lets in-use slots drain; growing wakes waiters at once."""
        assert n >= 0
        self.capacity = n
        self._dispatch()

    def stats(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "in_use": self._in_use,
            "queued": self._queued,
            "max_queued": self.max_queued,
            "queued_by_priority": {
                p: sum(len(q) for q in band.waiters.values()) for p, band in sorted(self._bands.items()) if band.waiters
            },  # (a band also holds the counters of teams let in without queueing: only those with waiters show)
            "queued_by_team": dict(self._queued_by_team),
            "in_use_by_team": dict(self._in_use_by_team),
            "dispatched": self.dispatched,
            "rejected_full": self.rejected_full,
            "displaced": self.displaced,
            "timed_out": self.timed_out,
            "cancelled": self.cancelled,
            "mean_hold_s": round(self._mean_hold_s, 4),
        }

    # -- internals (all synchronous: no await between a check and its update) --

    def _grant(self, ticket: Ticket) -> None:
        ticket.granted_at = time.monotonic()
        self._in_use += 1
        self._in_use_by_team[ticket.team_id] = self._in_use_by_team.get(ticket.team_id, 0) + 1
        self._in_use_by_band[ticket.priority] = self._in_use_by_band.get(ticket.priority, 0) + 1
        self.dispatched += 1

    def _free(self, ticket: Ticket) -> None:
        ticket.released = True
        self._in_use -= 1
        _dec(self._in_use_by_team, ticket.team_id)
        _dec(self._in_use_by_band, ticket.priority)

    def _enqueue(self, waiter: _Waiter, weight: int) -> None:
        ticket = waiter.ticket
        band = self._bands.setdefault(ticket.priority, _Band())
        band.waiters.setdefault(ticket.flow, deque()).append(waiter)
        band.scheduler.activate(ticket.flow, weight)
        self._queued += 1
        self._queued_by_team[ticket.team_id] = self._queued_by_team.get(ticket.team_id, 0) + 1
        self._dispatch()  # capacity may be free (set_capacity raced a full queue)

    def _unlink(self, waiter: _Waiter, band: _Band) -> None:
        flow = waiter.ticket.flow
        waiter.queued = False
        self._queued -= 1
        _dec(self._queued_by_team, waiter.ticket.team_id)
        if not band.waiters.get(flow):
            band.waiters.pop(flow, None)
            band.scheduler.deactivate(flow)

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiter gave up (cancelled / timed out): unqueue it, or pass on a slot it was just handed."""
        if waiter.queued:
            band = self._bands[waiter.ticket.priority]
            band.waiters[waiter.ticket.flow].remove(waiter)
            self._unlink(waiter, band)
        elif waiter.future.done() and not waiter.future.cancelled() and waiter.shed is None:
            # granted in the same instant it gave up: the next waiter gets the slot (a zero-length hold
            # says nothing about service time, so it stays out of the Retry-After estimate)
            self._free(waiter.ticket)
            self._dispatch()

    def _displace_for(self, priority: int) -> bool:
        """Make room in the full queue for a request of `priority` by shedding a waiter of a lower band, if any."""
        # Each team's FIFO ends with its latest arrival, so the last live waiter of each is the only candidate;
        # a cancelled one still queued (its task not yet resumed) leaves by itself and is no one's to shed.
        latest = (
            next((w for w in reversed(fifo) if not w.future.done()), None)
            for band in self._bands.values()
            for fifo in band.waiters.values()
        )
        victim = pick_displaced(priority, ((w.ticket.priority, w.ticket.id, w) for w in latest if w is not None))
        if victim is None:
            return False
        band = self._bands[victim.ticket.priority]
        band.waiters[victim.ticket.flow].remove(victim)
        self._unlink(victim, band)
        self.displaced += 1
        retry = queue_retry_after(self._queued, self.capacity, self._mean_hold_s)
        victim.shed = Rejected(
            "displaced",
            f"The server is at capacity: the queue is full ({self.max_queued} requests) and this request, of priority "
            f"{victim.ticket.priority}, gave its place to one of priority {priority}. Retry after {retry}s.",
            retry,
        )
        victim.future.set_result(None)
        return True

    def _dispatch(self) -> None:
        while self._queued and self._in_use < self.capacity:
            priority = min(p for p, band in self._bands.items() if band.waiters)
            band = self._bands[priority]
            team = band.scheduler.peek()
            assert team is not None and team in band.waiters, "scheduler and waiters out of step"
            waiter = band.waiters[team].popleft()
            live = not waiter.future.done()  # done = cancelled, its task not yet resumed to clean up: skip it
            if live:
                band.scheduler.served(team, waiter.ticket.units)  # before _unlink, which may deactivate the team
            self._unlink(waiter, band)
            if not live:
                continue
            self._grant(waiter.ticket)
            waiter.future.set_result(waiter.ticket)


def queue_for(queues: dict[str, DispatchQueue], pool: PoolConfig) -> DispatchQueue:
    """The pool's queue in `queues` (a pool added at run time gets one now), sized as its settings say now: a queue
    outlives its pool's changes and removal (tickets out are given back to it)."""
    queue = queues.get(pool.model)
    if queue is None:
        queue = queues[pool.model] = DispatchQueue(pool.capacity, pool.max_queued)
    elif queue.capacity != pool.capacity:
        queue.set_capacity(pool.capacity)
    queue.max_queued = pool.max_queued
    queue.fairness, queue.output_token_weight = pool.fairness, pool.output_token_weight
    return queue


def _dec(counts: dict[K, int], key: K) -> None:
    counts[key] -= 1
    if counts[key] == 0:
        del counts[key]
