"""A request's deadlines: its TTFT and total limits, each the tighter of its team's and its pool's (else the gateway's),
and the loop-time instants they end at. They are the request's budgets, spent by every hop, retry, backoff and fallback
it takes, never restarted by one: the total runs from its arrival (`deadline_base`), the TTFT from its first hop
(`ctx.ttft_clock`: a disaggregated pool's prefill hop, else the first hop sent) to the first token of whichever hop
sends one. The wait for a slot before that (the dispatch queue, a full member) is the queue timeout's, not the TTFT's.
"""

from __future__ import annotations

import asyncio

from tokenweir.gateway.config import GatewayConfig
from tokenweir.gateway.request.context import RequestContext


def limits(config: GatewayConfig, ctx: RequestContext) -> tuple[float, float]:
    """TTFT and total limits of the request, in seconds: the tighter of its team's and its pool's, else the
    gateway's."""
    pool, t = ctx.pools[ctx.model].cfg, config.timeouts
    ttft = _tightest(ctx.limits.ttft_timeout_s, pool.ttft_timeout_s) or t.ttft_s
    total = _tightest(ctx.limits.total_timeout_s, pool.total_timeout_s) or t.total_s
    return ttft, total


def start_ttft_clock(ctx: RequestContext) -> None:
    """Its first hop goes out: the TTFT budget starts now, once (a later hop, retry or fallback spends what is left)."""
    if ctx.ttft_clock is None:
        ctx.ttft_clock = asyncio.get_running_loop().time()


def first_token_deadline(config: GatewayConfig, ctx: RequestContext) -> float:
    """Loop time by which a stream's first token must come: its TTFT clock's start (now, if no hop went out yet) plus
    the limit, and never past the total deadline."""
    ttft, total = limits(config, ctx)
    return min((ctx.ttft_clock or asyncio.get_running_loop().time()) + ttft, ctx.deadline_base + total)


def total_deadline(config: GatewayConfig, ctx: RequestContext) -> float:
    """Loop time by which the whole response must have come."""
    return ctx.deadline_base + limits(config, ctx)[1]


def answer_deadline(config: GatewayConfig, ctx: RequestContext) -> float:
    """What a hop tried now must answer by: a stream its first token, any other request its response."""
    return first_token_deadline(config, ctx) if ctx.stream else total_deadline(config, ctx)


def instance_too_slow(config: GatewayConfig, ctx: RequestContext, kind: str) -> bool:
    """A timeout counts against the instance's circuit only when the pool's own limit fired: a hung upstream must
    be routed around, but a team's tighter limit says nothing about the instance other teams share."""
    pool, defaults = ctx.pools[ctx.model].cfg, config.timeouts
    team_limit = getattr(ctx.limits, f"{kind}_timeout_s")
    pool_limit = getattr(pool, f"{kind}_timeout_s") or getattr(defaults, f"{kind}_s")
    return not team_limit or team_limit >= pool_limit


def _tightest(*values: float | None) -> float | None:
    present = [v for v in values if v]
    return min(present) if present else None
