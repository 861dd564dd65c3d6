"""A request's deadlines, worked out once by dispatch, and the admitted facts its context fixes at admission."""

from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest

from tokenweir.gateway.config import GatewayConfig
from tokenweir.gateway.request.context import ADMITTED_FACTS, RequestContext
from tokenweir.gateway.request.deadlines import Deadlines
from tokenweir.policies.limits import TeamLimits


def _context(limits: TeamLimits, ttft: float | None, total: float | None) -> RequestContext:
    pool = types.SimpleNamespace(cfg=types.SimpleNamespace(ttft_timeout_s=ttft, total_timeout_s=total))
    ctx = RequestContext(
        request_id="r", kind="chat", t0=0.0, team_id="t", key_id="k", model="m", limits=limits, body={},
        deadline_base=100.0,
    )  # fmt: skip
    ctx.routes = types.SimpleNamespace(pools={"m": pool}, aliases={})  # type: ignore[assignment]
    return ctx


def test_each_limit_is_the_tighter_of_the_teams_and_the_pools_and_only_the_pools_blames_the_instance():
    config = GatewayConfig()  # the gateway's own limits where neither sets one
    gateway = Deadlines.of(config, _context(TeamLimits(), None, None))
    assert (gateway.ttft_s, gateway.total_s) == (config.timeouts.ttft_s, config.timeouts.total_s)
    assert gateway.ttft_blames_instance and gateway.total_blames_instance

    team_tighter = Deadlines.of(config, _context(TeamLimits(ttft_timeout_s=1.0, total_timeout_s=5.0), 2.0, 50.0))
    assert (team_tighter.ttft_s, team_tighter.total_s) == (1.0, 5.0)
    assert not team_tighter.ttft_blames_instance and not team_tighter.total_blames_instance  # the team's fired

    pool_tighter = Deadlines.of(config, _context(TeamLimits(ttft_timeout_s=3.0, total_timeout_s=60.0), 2.0, 50.0))
    assert (pool_tighter.ttft_s, pool_tighter.total_s) == (2.0, 50.0)
    assert pool_tighter.ttft_blames_instance and pool_tighter.total_blames_instance
    assert pool_tighter.total == 150.0  # from arrival (the context's deadline_base)


async def test_the_ttft_clock_starts_once_and_never_passes_the_total():
    budget = Deadlines(base=0.0, ttft_s=5.0, total_s=10.0, ttft_blames_instance=True, total_blames_instance=True)
    now = asyncio.get_running_loop().time()
    budget.start_ttft_clock()
    started = budget.ttft_clock
    assert started is not None and started >= now
    await asyncio.sleep(0.01)
    budget.start_ttft_clock()  # a later hop spends what is left: the clock is not restarted
    assert budget.ttft_clock == started
    assert budget.first_token() == min(started + 5.0, 10.0)
    assert budget.answer(stream=True) == budget.first_token() and budget.answer(stream=False) == 10.0


def test_a_sealed_context_refuses_every_admitted_fact_and_takes_the_rest():
    ctx = _context(TeamLimits(), None, None)
    ctx.max_tokens = 16  # admission still deciding
    ctx.seal()
    for name in sorted(ADMITTED_FACTS):
        with pytest.raises(dataclasses.FrozenInstanceError, match=f"{name} was fixed at admission"):
            setattr(ctx, name, getattr(ctx, name))
    assert ctx.max_tokens == 16
    ctx.finish_reason, ctx.usage = "stop", {"prompt_tokens": 1}  # what the request did is still written as it goes
    ctx.outcome.decide("timeout", "total_timeout", 504)
    assert ctx.finish_reason == "stop" and ctx.outcome.status == "timeout"


def test_every_admitted_fact_is_a_field_of_the_context():
    names = {f.name for f in dataclasses.fields(RequestContext)}
    assert names >= ADMITTED_FACTS, ADMITTED_FACTS - names  # a misspelt name would seal nothing
