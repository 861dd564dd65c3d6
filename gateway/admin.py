"""Admin API: teams, their limits and keys, usage and live state. Every route needs an admin key.

Changes reach the request path through the auth cache (<= 1 s on every replica; at once on this one, which
drops its cache after each write). Bad input gets an OpenAI-style 400 naming the field in `param`.
"""

from __future__ import annotations

import asyncio
import time
from datetime import date
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from gateway.admin_models import (
    ID_DOC,
    ID_PATTERN,
    PLAIN_TEXT_PATTERN,
    TEAM_NAME_PATTERN,
    Deleted,
    ErrorBody,
    KeyCreate,
    KeyCreated,
    KeyLimitsBody,
    KeyList,
    KeyOut,
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
from gateway.auth import require_admin
from gateway.errors import APIError, error_response
from gateway.services import Services, ServicesDep
from gateway.state import StateUnavailable
from gateway.store import Conflict, NotFound, Team
from gateway.store_db import DB_ERRORS
from policies.budget import DAY, MONTH, period_start_day
from policies.pricing import micros_to_usd

# --- validation errors, OpenAI-shaped ----------------------------------------------------------------------

_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "json_invalid": "invalid_json",
}


# What a pattern means, for the message (the regex itself helps nobody).
_PATTERNS = {
    TEAM_NAME_PATTERN: "expected letters, digits, '.', '_' or '-', starting with a letter or digit",
    PLAIN_TEXT_PATTERN: "control characters are not allowed",
    ID_PATTERN: "expected an id of letters, digits, '.', '_' or '-'",
}


def admin_validation_error(exc: RequestValidationError) -> APIError:
    """The first problem, with the field as a dotted path in `param` ('limits.rpm'), as OpenAI reports it."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    where = loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc
    if err.get("type") == "json_invalid":
        return APIError(400, f"The request body is not valid JSON: {err.get('msg')}.", "invalid_json")
    param = ".".join(where) or None
    message = err.get("msg", "Invalid value")
    if err.get("type") == "string_pattern_mismatch":
        message = _PATTERNS.get((err.get("ctx") or {}).get("pattern"), message)
    elif err.get("type") == "string_unicode":
        message = "expected valid Unicode text (no lone surrogates)"
    elif err.get("type") == "value_error":
        message = message.removeprefix("Value error, ")
    message = f"Invalid '{param}': {message}." if param else f"Invalid request body: {message}."
    return APIError(400, message, _CODES.get(err.get("type"), "invalid_value"), param=param)


class _OpenAIErrorRoute(APIRoute):
    """Renders request validation failures as OpenAI errors without needing a handler on the app."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return error_response(admin_validation_error(exc))
            except APIError as err:  # also from require_admin: the router works even on an app without the handler
                return error_response(err)
            except HTTPException as exc:  # FastAPI's own: a body it could not read (e.g. JSON nested too deep)
                if exc.status_code != 400:
                    raise
                return error_response(APIError(400, f"Invalid request body: {exc.detail}.", "invalid_json"))

        return route


def _err(description: str) -> dict:
    return {"model": ErrorBody, "description": description}


TeamId = Annotated[str, Path(max_length=64, pattern=ID_PATTERN, description="The team's id. " + ID_DOC)]
KeyId = Annotated[str, Path(max_length=64, pattern=ID_PATTERN, description="The key's id. " + ID_DOC)]


router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    dependencies=[Depends(require_admin)],
    route_class=_OpenAIErrorRoute,
    responses={
        400: _err("Invalid request; `param` names the field."),
        401: _err("Missing, malformed, unknown, revoked or expired API key."),
        403: _err("Not an admin key, or its team is disabled."),
        "4XX": _err("OpenAI-style error."),
        503: _err("The store is unavailable; retry after `Retry-After` seconds."),
    },
)

# --- helpers ----------------------------------------------------------------------------------------------


async def _call(fn, *args, **kwargs):
    """Run a store call off the event loop, mapping store errors to API errors."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except NotFound as exc:
        raise APIError(
            404, f"No such {exc.what}: {exc.ident!r}.", f"{exc.what}_not_found", param=f"{exc.what}_id"
        ) from exc
    except Conflict as exc:
        raise APIError(409, f"{exc}; choose another name.", "duplicate_team_name", param="name") from exc
    except DB_ERRORS as exc:
        raise APIError(
            503,
            f"The store is unavailable ({type(exc).__name__}); retry shortly.",
            "store_unavailable",
            headers={"Retry-After": "1"},
        ) from exc


def _changed(services: Services) -> None:
    # This replica sees the change at once; the others within their cache TTL (<= 1 s).
    if services.authenticator is not None:
        services.authenticator.invalidate()


async def _team_or_404(services: Services, team_id: str) -> Team:
    team = await _call(services.store.get_team, team_id)
    if team is None:
        raise APIError(404, f"No such team: {team_id!r}.", "team_not_found", param="team_id")
    return team


# --- teams ------------------------------------------------------------------------------------------------


@router.post("/teams", status_code=201, summary="Create a team", responses={409: _err("Name taken.")})
async def create_team(body: TeamCreate, services: ServicesDep) -> TeamOut:
    team = await _call(services.store.create_team, body.name, body.limits.to_limits(), body.enabled)
    return TeamOut.of(team)


@router.get("/teams", summary="List teams")
async def list_teams(services: ServicesDep) -> TeamList:
    return TeamList(data=[TeamOut.of(t) for t in await _call(services.store.list_teams)])


@router.get("/teams/{team_id}", summary="Get a team", responses={404: _err("No such team.")})
async def get_team(team_id: TeamId, services: ServicesDep) -> TeamOut:
    return TeamOut.of(await _team_or_404(services, team_id))


@router.patch(
    "/teams/{team_id}",
    summary="Rename, enable or disable a team",
    responses={404: _err("No such team."), 409: _err("Name taken.")},
)
async def update_team(team_id: TeamId, body: TeamUpdate, services: ServicesDep) -> TeamOut:
    team = await _call(services.store.update_team, team_id, name=body.name, enabled=body.enabled)
    _changed(services)
    return TeamOut.of(team)


@router.delete(
    "/teams/{team_id}",
    summary="Delete a team and its keys (its usage history stays)",
    responses={404: _err("No such team.")},
)
async def delete_team(team_id: TeamId, services: ServicesDep) -> Deleted:
    await _call(services.store.delete_team, team_id)
    _changed(services)
    return Deleted(id=team_id, object="team")


@router.put(
    "/teams/{team_id}/limits",
    summary="Replace a team's limits (omitted fields become unlimited)",
    responses={404: _err("No such team.")},
)
async def set_limits(team_id: TeamId, body: Limits, services: ServicesDep) -> Limits:
    team = await _call(services.store.set_limits, team_id, body.to_limits())
    _changed(services)
    return Limits.of(team.limits)


@router.get("/teams/{team_id}/limits", summary="Get a team's limits", responses={404: _err("No such team.")})
async def get_limits(team_id: TeamId, services: ServicesDep) -> Limits:
    return Limits.of((await _team_or_404(services, team_id)).limits)


@router.get(
    "/teams/{team_id}/state",
    summary="Live counters and remaining budgets of a team",
    responses={404: _err("No such team.")},
)
async def team_state(team_id: TeamId, services: ServicesDep) -> TeamState:
    team = await _team_or_404(services, team_id)
    now = time.time()
    day, month_start = period_start_day(DAY, now), period_start_day(MONTH, now)
    store = services.store
    spent_today = await _call(store.spent_tokens, team_id, day)
    spent_month = await _call(store.spent_tokens, team_id, month_start)
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
            live = await backend.read_snapshot(team_id)
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


# --- keys -------------------------------------------------------------------------------------------------


@router.post(
    "/teams/{team_id}/keys",
    status_code=201,
    summary="Create an API key for a team (the secret is returned once)",
    responses={404: _err("No such team.")},
)
async def create_team_key(team_id: TeamId, body: KeyCreate, services: ServicesDep) -> KeyCreated:
    limits = body.limits.to_limits() if body.limits is not None else None
    store = services.store
    secret, key = await _call(store.create_key, team_id, body.name, expires_at=body.expiry(), limits=limits)
    return KeyCreated(secret=secret, **KeyOut.of(key).model_dump())


@router.get("/teams/{team_id}/keys", summary="List a team's keys", responses={404: _err("No such team.")})
async def list_team_keys(team_id: TeamId, services: ServicesDep) -> KeyList:
    await _team_or_404(services, team_id)
    return KeyList(data=[KeyOut.of(k) for k in await _call(services.store.list_keys, team_id)])


@router.post("/keys", status_code=201, summary="Create an admin key (no team; the secret is returned once)")
async def create_admin_key(body: KeyCreate, services: ServicesDep) -> KeyCreated:
    if body.limits is not None:
        raise _admin_key_limits()
    store = services.store
    secret, key = await _call(store.create_key, None, body.name, is_admin=True, expires_at=body.expiry())
    return KeyCreated(secret=secret, **KeyOut.of(key).model_dump())


@router.get("/keys", summary="List keys, of every team or of one")
async def list_keys(
    services: ServicesDep,
    team_id: str | None = Query(
        None, max_length=64, pattern=ID_PATTERN, description="Only this team's keys. " + ID_DOC
    ),
) -> KeyList:
    return KeyList(data=[KeyOut.of(k) for k in await _call(services.store.list_keys, team_id)])


@router.delete(
    "/keys/{key_id}",
    summary="Revoke a key (takes effect within ~1 s on every replica)",
    responses={404: _err("No such key.")},
)
async def revoke_key(key_id: KeyId, services: ServicesDep) -> KeyOut:
    key = await _call(services.store.revoke_key, key_id)
    _changed(services)
    return KeyOut.of(key)


def _admin_key_limits() -> APIError:
    return APIError(
        400,
        "Invalid 'limits': admin keys belong to no team and have no limits; create a team key for that.",
        "invalid_value",
        param="limits",
    )


async def _key_or_404(services: Services, key_id: str):
    key = await _call(services.store.get_key, key_id)
    if key is None:
        raise APIError(404, f"No such key: {key_id!r}.", "key_not_found", param="key_id")
    return key


@router.get("/keys/{key_id}/limits", summary="Get a key's own limits", responses={404: _err("No such key.")})
async def get_key_limits(key_id: KeyId, services: ServicesDep) -> KeyLimitsBody:
    return KeyLimitsBody.of((await _key_or_404(services, key_id)).limits)


@router.put(
    "/keys/{key_id}/limits",
    summary="Replace a key's own limits (omitted fields: none of its own; its team's still apply)",
    responses={404: _err("No such key.")},
)
async def set_key_limits(key_id: KeyId, body: KeyLimitsBody, services: ServicesDep) -> KeyLimitsBody:
    if (await _key_or_404(services, key_id)).team_id is None:
        raise _admin_key_limits()
    key = await _call(services.store.set_key_limits, key_id, body.to_limits())
    _changed(services)
    return KeyLimitsBody.of(key.limits)


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
    rows = await _call(
        services.store.usage,
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
    rows = await _call(
        services.store.usage_by,
        group_by,
        team_id,
        since.isoformat() if since else None,
        until.isoformat() if until else None,
    )
    data, total = [], UsageTotals(cost_usd=0.0)
    cost_micros = 0
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
                cost_usd=micros_to_usd(cost),
                **ident,
            )
        )
        total.requests += requests
        total.prompt_tokens += prompt
        total.completion_tokens += completion
        total.cached_tokens += cached
        cost_micros += cost
    total.cost_usd = micros_to_usd(cost_micros)
    return UsageList(data=data, total=total)
