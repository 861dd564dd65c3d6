"""Admin API: teams, their limits, usage and live state; keys in gateway.admin.keys. Every route needs an admin key.

Changes reach the request path through the auth cache (<= 1 s on every replica; at once on this one, which
drops its cache after each write). Bad input gets an OpenAI-style 400 naming the field in `param`.
"""

from __future__ import annotations

import time
from datetime import date
from typing import Literal

from fastapi import APIRouter, Depends, Query

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.admin.common import (
    OpenAIErrorRoute,
    TeamId,
    error_doc,
    invalidate_auth_cache,
    store_call,
    store_of,
    team_or_404,
)
from tokenweir.gateway.admin.keys import router as keys_router
from tokenweir.gateway.admin.models import (
    ID_DOC,
    ID_PATTERN,
    Deleted,
    Limits,
    StoredSpend,
    TeamCreate,
    TeamList,
    TeamOut,
    TeamState,
    TeamUpdate,
    UsageList,
    UsageOut,
    UsageTotals,
)
from tokenweir.gateway.admin.routing import router as routing_router
from tokenweir.gateway.deps.callers import require_admin
from tokenweir.gateway.deps.services import Services, ServicesDep
from tokenweir.gateway.state.backend import StateUnavailable
from tokenweir.policies.budget import DAY, MONTH, period_start_day
from tokenweir.policies.pricing import femtos_to_usd
from tokenweir.policies.snapshot import with_limits

router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    dependencies=[Depends(require_admin)],
    route_class=OpenAIErrorRoute,
    responses={
        400: error_doc("Invalid request; `param` names the field."),
        401: error_doc("Missing, malformed, unknown, revoked or expired API key."),
        403: error_doc("Not an admin key, or its team is disabled."),
        "4XX": error_doc("OpenAI-style error."),
        503: error_doc("The store is unavailable; retry after `Retry-After` seconds."),
    },
)

# --- teams ------------------------------------------------------------------------------------------------


@router.post("/teams", status_code=201, summary="Create a team", responses={409: error_doc("Name taken.")})
async def create_team(body: TeamCreate, services: ServicesDep) -> TeamOut:
    team = await store_call(store_of(services).create_team, body.name, body.limits.to_limits(), body.enabled)
    return TeamOut.of(team)


@router.get("/teams", summary="List teams")
async def list_teams(services: ServicesDep) -> TeamList:
    return TeamList(data=[TeamOut.of(t) for t in await store_call(store_of(services).list_teams)])


@router.get("/teams/{team_id}", summary="Get a team", responses={404: error_doc("No such team.")})
async def get_team(team_id: TeamId, services: ServicesDep) -> TeamOut:
    return TeamOut.of(await team_or_404(services, team_id))


@router.patch(
    "/teams/{team_id}",
    summary="Rename, enable or disable a team",
    responses={404: error_doc("No such team."), 409: error_doc("Name taken.")},
)
async def update_team(team_id: TeamId, body: TeamUpdate, services: ServicesDep) -> TeamOut:
    team = await store_call(store_of(services).update_team, team_id, name=body.name, enabled=body.enabled)
    invalidate_auth_cache(services)
    return TeamOut.of(team)


@router.delete(
    "/teams/{team_id}",
    summary="Delete a team and its keys (its usage history stays)",
    responses={404: error_doc("No such team.")},
)
async def delete_team(team_id: TeamId, services: ServicesDep) -> Deleted:
    await store_call(store_of(services).delete_team, team_id)
    invalidate_auth_cache(services)
    return Deleted(id=team_id, object="team")


@router.put(
    "/teams/{team_id}/limits",
    summary="Replace a team's limits (omitted fields become unlimited)",
    responses={404: error_doc("No such team.")},
)
async def set_limits(team_id: TeamId, body: Limits, services: ServicesDep) -> Limits:
    team = await store_call(store_of(services).set_limits, team_id, body.to_limits())
    invalidate_auth_cache(services)
    return Limits.of(team.limits)


@router.get("/teams/{team_id}/limits", summary="Get a team's limits", responses={404: error_doc("No such team.")})
async def get_limits(team_id: TeamId, services: ServicesDep) -> Limits:
    return Limits.of((await team_or_404(services, team_id)).limits)


@router.get(
    "/teams/{team_id}/state",
    summary="Live counters and remaining budgets of a team",
    responses={404: error_doc("No such team.")},
)
async def team_state(team_id: TeamId, services: ServicesDep) -> TeamState:
    team = await team_or_404(services, team_id)
    now = time.time()
    day, month_start = period_start_day(DAY, now), period_start_day(MONTH, now)
    store = store_of(services)
    spent_today = await store_call(store.spent_tokens, team_id, day)
    spent_month = await store_call(store.spent_tokens, team_id, month_start)
    limits = team.limits
    stored = StoredSpend(
        day=day,
        month_start=month_start,
        spent_today=spent_today,
        spent_month=spent_month,
        remaining_day=None if limits.tokens_per_day is None else max(0, limits.tokens_per_day - spent_today),
        remaining_month=None if limits.tokens_per_month is None else max(0, limits.tokens_per_month - spent_month),
    )
    live, live_error = None, None
    backend = services.state
    if backend is not None:
        try:
            live = with_limits(await backend.snapshot(team_id), limits)
        except StateUnavailable as e:
            live_error = f"state_unavailable: {e}"
    return TeamState(
        team_id=team.id,
        name=team.name,
        enabled=team.enabled,
        limits=Limits.of(limits),
        stored=stored,
        live=live,
        live_error=live_error,
    )


# --- keys: gateway.admin.keys (included here, so the OpenAPI document lists them between teams and usage) ------

router.include_router(keys_router)
router.include_router(routing_router)


# --- usage ------------------------------------------------------------------------------------------------


@router.get(
    "/usage",
    summary="Daily token usage per team and model, per key, or per end user",
    response_model_exclude_none=True,  # key_id / user / cost_usd only in the groupings that have them
)
async def usage(
    services: ServicesDep,
    team_id: str | None = Query(None, max_length=64, pattern=ID_PATTERN, description="Only this team. " + ID_DOC),
    since: date | None = Query(None, description="First UTC day, inclusive (YYYY-MM-DD)."),
    until: date | None = Query(None, description="Last UTC day, inclusive (YYYY-MM-DD)."),
    group_by: Literal["team", "key", "user"] = Query(
        "team", description="Rows per team and model (default), per API key, or per end user (the `user` field)."
    ),
) -> UsageList:
    if since is not None and until is not None and since > until:
        raise APIError(400, f"Invalid 'until': {until} is before since={since}.", "invalid_value", param="until")
    if group_by != "team":
        return await _usage_by(services, group_by, team_id, since, until)
    rows = await store_call(
        store_of(services).usage,
        team_id,
        since.isoformat() if since else None,
        until.isoformat() if until else None,
    )
    total = UsageTotals()
    for r in rows:
        total.requests += r.requests
        total.prompt_tokens += r.prompt_tokens
        total.completion_tokens += r.completion_tokens
        total.cached_tokens += r.cached_tokens
    return UsageList(data=[UsageOut(**r.__dict__) for r in rows], total=total)


async def _usage_by(services: Services, group_by: str, team_id, since: date | None, until: date | None) -> UsageList:
    rows = await store_call(
        store_of(services).usage_by,
        group_by,
        team_id,
        since.isoformat() if since else None,
        until.isoformat() if until else None,
    )
    data, total = [], UsageTotals(cost_usd=0.0)
    cost_femtos = 0  # exact: rendered in USD once, for the total as for each row
    for team, who, day, model, requests, prompt, completion, cached, cost in rows:
        ident = {"key_id": who} if group_by == "key" else {"user": who}
        data.append(
            UsageOut(
                team_id=team,
                day=day,
                model=model,
                requests=requests,
                prompt_tokens=prompt,
                completion_tokens=completion,
                cached_tokens=cached,
                cost_usd=femtos_to_usd(cost),
                **ident,
            )
        )
        total.requests += requests
        total.prompt_tokens += prompt
        total.completion_tokens += completion
        total.cached_tokens += cached
        cost_femtos += cost
    total.cost_usd = femtos_to_usd(cost_femtos)
    return UsageList(data=data, total=total)
