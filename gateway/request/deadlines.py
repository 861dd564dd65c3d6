"""A request's deadlines: its TTFT and total limits, each the tighter of its team's and its pool's (else the gateway's),
and the loop-time instants they end at. They are the request's budgets, spent by every hop, retry, backoff and fallback
it takes, never restarted by one: the total runs from its arrival (`base`), the TTFT from its first hop (`ttft_clock`:
a disaggregated pool's prefill hop, else the first hop sent) to the first token of whichever hop sends one. The wait
for a slot before that (the dispatch queue, a full member) is the queue timeout's, not the TTFT's.

Dispatch works them out once per request and hands them to the stages that spend them (the prefill hop, the stream
pump, the whole answer): those read these few numbers, not the request's whole context.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tokenweir.gateway.config import GatewayConfig
from tokenweir.gateway.request.context import RequestContext


@dataclass(slots=True)
class Deadlines:
    base: float  # loop.time() at arrival: deadlines are loop-time instants (uvloop's clock ticks in ms)
    ttft_s: float
    total_s: float
    # whether a timeout of that kind counts against the instance's circuit: only when the pool's own limit fired. A
    # hung upstream must be routed around, but a team's tighter limit says nothing about the instance other teams share
    ttft_blames_instance: bool
    total_blames_instance: bool
    ttft_clock: float | None = None  # loop time the first hop went out: the TTFT budget runs from it

    @classmethod
    def of(cls, config: GatewayConfig, ctx: RequestContext) -> Deadlines:
        """The request's deadlines: its team's and its pool's limits (the gateway's where neither sets one)."""
        pool, defaults, team = ctx.pools[ctx.model].cfg, config.timeouts, ctx.limits
        pool_ttft = pool.ttft_timeout_s or defaults.ttft_s
        pool_total = pool.total_timeout_s or defaults.total_s
        return cls(
            base=ctx.deadline_base,
            ttft_s=_tightest(team.ttft_timeout_s, pool.ttft_timeout_s) or defaults.ttft_s,
            total_s=_tightest(team.total_timeout_s, pool.total_timeout_s) or defaults.total_s,
            ttft_blames_instance=not team.ttft_timeout_s or team.ttft_timeout_s >= pool_ttft,
            total_blames_instance=not team.total_timeout_s or team.total_timeout_s >= pool_total,
        )

    def start_ttft_clock(self) -> None:
        """Its first hop goes out: the TTFT budget starts now, once (a later hop, retry or fallback spends what is
        left)."""
        if self.ttft_clock is None:
            self.ttft_clock = asyncio.get_running_loop().time()

    @property
    def total(self) -> float:
        """Loop time by which the whole response must have come."""
        return self.base + self.total_s

    def first_token(self) -> float:
        """Loop time by which a stream's first token must come: its TTFT clock's start (now, if no hop went out yet)
        plus the limit, and never past the total deadline."""
        return min((self.ttft_clock or asyncio.get_running_loop().time()) + self.ttft_s, self.total)

    def answer(self, stream: bool) -> float:
        """What a hop tried now must answer by: a stream its first token, any other request its response."""
        return self.first_token() if stream else self.total


def _tightest(*values: float | None) -> float | None:
    present = [v for v in values if v]
    return min(present) if present else None
