"""Admin API: teams, their limits and keys, usage and live state. Every route needs an admin key.

Changes reach the request path through the auth cache (<= 1 s on every replica; at once on this one, which
drops its cache after each write). Bad input gets an OpenAI-style 400 naming the field in `param`.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, date, datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator
from starlette.exceptions import HTTPException

from gateway.auth import require_admin
from gateway.errors import APIError, error_response
from gateway.state import StateUnavailable
from gateway.store import DB_ERRORS, ApiKey, Conflict, NotFound, Store, Team
from policies.limits import TeamLimits

# --- request / response models ---------------------------------------------------------------------------

# Upper bounds on what the admin API accepts: far above any real limit, far below what the store's columns hold
# (BIGINT for rates and budgets; INTEGER, 2**31 - 1, for concurrency and per-request token caps).
MAX_TOKEN_BUDGET = 10**15
MAX_COUNT = 10**9
MAX_TIMEOUT_S = 10 * 86400.0  # 10 days
MAX_KEY_LIFETIME_S = 100 * 365 * 86400.0  # 100 years

# Plain text for names: no control characters (they end up in logs; PostgreSQL refuses NUL). A pattern also makes
# pydantic refuse lone surrogates (not encodable as UTF-8, so no database could store them).
_PLAIN = r"^[^\x00-\x1f\x7f]*$"
ModelName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=_PLAIN)]
# Ids are the store's own ('team_' / 'key_' + hex): anything longer or stranger cannot exist.
_ID = r"^[A-Za-z0-9._-]+$"
_ID_DOC = "1-64 letters, digits, '.', '_' or '-'."


class Limits(BaseModel):
    """A team's limits. Omitted or null means unlimited (timeouts: the gateway default)."""

    model_config = ConfigDict(extra="forbid")

    rpm: int | None = Field(None, ge=1, le=MAX_COUNT, description="Requests per minute.")
    tpm: int | None = Field(
        None, ge=1, le=MAX_TOKEN_BUDGET, description="Tokens (prompt + max_tokens reserved) per minute."
    )
    tokens_per_day: int | None = Field(None, ge=0, le=MAX_TOKEN_BUDGET, description="Token budget per UTC day.")
    tokens_per_month: int | None = Field(
        None, ge=0, le=MAX_TOKEN_BUDGET, description="Token budget per UTC calendar month."
    )
    max_concurrency: int | None = Field(None, ge=1, le=MAX_COUNT, description="Requests in flight at once.")
    max_prompt_tokens: int | None = Field(None, ge=1, le=MAX_COUNT, description="Longest prompt accepted.")
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_COUNT, description="Cap on max_tokens.")
    allowed_models: list[ModelName] | None = Field(
        None, max_length=1000, description="Models the team may use; null means all."
    )
    priority: int = Field(1, ge=0, le=2, description="0 critical, 1 standard, 2 batch; lower runs first.")
    weight: int = Field(1, ge=1, le=1000, description="Fair share against other teams in the same band.")
    queue_timeout_s: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_S, description="Longest wait in the dispatch queue."
    )
    ttft_timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, description="Longest wait for the first token.")
    total_timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, description="Longest whole request.")

    def to_limits(self) -> TeamLimits:
        return TeamLimits.from_dict(self.model_dump())

    @classmethod
    def of(cls, limits: TeamLimits) -> Limits:
        # Not validated: the bounds are for what comes in; a stored value is shown as it is, whatever it is.
        return cls.model_construct(**limits.to_dict())


# Team names end up in metrics labels and log lines: keep them plain.
_TEAM_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
TeamName = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=_TEAM_NAME)]
_NAME_DOC = "Unique; 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit."


class TeamCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: TeamName = Field(description=_NAME_DOC)
    enabled: bool = True
    limits: Limits = Field(default_factory=Limits)


class TeamUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: TeamName | None = Field(None, description=_NAME_DOC)
    enabled: bool | None = None


class TeamOut(BaseModel):
    object: Literal["team"] = "team"
    id: str
    name: str
    enabled: bool
    created_at: str
    limits: Limits

    @classmethod
    def of(cls, team: Team) -> TeamOut:
        return cls(
            id=team.id, name=team.name, enabled=team.enabled, created_at=team.created_at, limits=Limits.of(team.limits)
        )


class TeamList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TeamOut]


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool = True


def _sane_expiry(value: datetime | None) -> datetime | None:
    # Checked on the year first: converting an extreme time between time zones overflows.
    last = datetime.now(UTC).year + 100
    if value is not None and not 1970 <= value.year <= last:
        raise ValueError(f"expected a time between 1970 and {last} (at most 100 years from now)")
    return value


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=_PLAIN,
        description="What the key is for, e.g. 'ci' or 'alice-laptop'. No control characters.",
    )
    expires_at: Annotated[datetime | None, AfterValidator(_sane_expiry)] = Field(
        None, description="ISO 8601, from 1970 to 100 years from now; naive times are UTC."
    )
    expires_in_s: float | None = Field(
        None, gt=0, le=MAX_KEY_LIFETIME_S, description="Alternative to expires_at: lifetime in seconds (<= 100 years)."
    )

    @model_validator(mode="after")
    def _one_expiry(self) -> KeyCreate:
        if self.expires_at is not None and self.expires_in_s is not None:
            raise ValueError("give expires_at or expires_in_s, not both")
        return self

    def expiry(self) -> datetime | None:
        if self.expires_in_s is not None:
            return datetime.now(UTC) + timedelta(seconds=self.expires_in_s)
        return self.expires_at


class KeyOut(BaseModel):
    object: Literal["api_key"] = "api_key"
    id: str
    team_id: str | None
    name: str
    prefix: str = Field(description="The first characters of the secret, to recognise it.")
    is_admin: bool
    status: Literal["active", "revoked", "expired"]
    created_at: str
    expires_at: str | None
    revoked_at: str | None

    @classmethod
    def of(cls, key: ApiKey) -> KeyOut:
        status = "revoked" if key.revoked_at else "expired" if key.is_expired() else "active"
        return cls(status=status, **{k: getattr(key, k) for k in ApiKey.__dataclass_fields__})


class KeyCreated(KeyOut):
    secret: str = Field(description="The API key. Shown only in this response: store it now.")


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyOut]


class UsageOut(BaseModel):
    team_id: str
    day: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class UsageTotals(BaseModel):
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class UsageList(BaseModel):
    object: Literal["list"] = "list"
    data: list[UsageOut]
    total: UsageTotals


class StoredSpend(BaseModel):
    """From the store, which lags live traffic by the usage flush interval (~2 s)."""

    day: str
    month_start: str
    spent_today: int
    spent_month: int
    remaining_day: int | None = Field(description="null when the team has no daily budget.")
    remaining_month: int | None = Field(description="null when the team has no monthly budget.")


class TeamState(BaseModel):
    object: Literal["team_state"] = "team_state"
    team_id: str
    name: str
    enabled: bool
    limits: Limits
    stored: StoredSpend
    live: dict[str, Any] | None = Field(
        description="Live counters (shared by every replica with a Redis state); null without a state backend or "
        "while it is unreachable (see live_error)."
    )
    live_error: str | None = Field(None, description="Why `live` is null while a state backend is configured.")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


# --- validation errors, OpenAI-shaped ----------------------------------------------------------------------

_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "json_invalid": "invalid_json",
}


# What a pattern means, for the message (the regex itself helps nobody).
_PATTERNS = {
    _TEAM_NAME: "expected letters, digits, '.', '_' or '-', starting with a letter or digit",
    _PLAIN: "control characters are not allowed",
    _ID: "expected an id of letters, digits, '.', '_' or '-'",
}


def validation_error(exc: RequestValidationError) -> APIError:
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
                return error_response(validation_error(exc))
            except APIError as err:  # also from require_admin: the router works even on an app without the handler
                return error_response(err)
            except HTTPException as exc:  # FastAPI's own: a body it could not read (e.g. JSON nested too deep)
                if exc.status_code != 400:
                    raise
                return error_response(APIError(400, f"Invalid request body: {exc.detail}.", "invalid_json"))

        return route


def _err(description: str) -> dict:
    return {"model": ErrorBody, "description": description}


TeamId = Annotated[str, Path(max_length=64, pattern=_ID, description="The team's id. " + _ID_DOC)]
KeyId = Annotated[str, Path(max_length=64, pattern=_ID, description="The key's id. " + _ID_DOC)]


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


def _store(request: Request) -> Store:
    return request.app.state.store


async def _call(request: Request, fn, *args, **kwargs):
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


def _changed(request: Request) -> None:
    # This replica sees the change at once; the others within their cache TTL (<= 1 s).
    authenticator = getattr(request.app.state, "authenticator", None)
    if authenticator is not None:
        authenticator.invalidate()


async def _team_or_404(request: Request, team_id: str) -> Team:
    team = await _call(request, _store(request).get_team, team_id)
    if team is None:
        raise APIError(404, f"No such team: {team_id!r}.", "team_not_found", param="team_id")
    return team


# --- teams ------------------------------------------------------------------------------------------------


@router.post("/teams", status_code=201, summary="Create a team", responses={409: _err("Name taken.")})
async def create_team(body: TeamCreate, request: Request) -> TeamOut:
    team = await _call(request, _store(request).create_team, body.name, body.limits.to_limits(), body.enabled)
    return TeamOut.of(team)


@router.get("/teams", summary="List teams")
async def list_teams(request: Request) -> TeamList:
    return TeamList(data=[TeamOut.of(t) for t in await _call(request, _store(request).list_teams)])


@router.get("/teams/{team_id}", summary="Get a team", responses={404: _err("No such team.")})
async def get_team(team_id: TeamId, request: Request) -> TeamOut:
    return TeamOut.of(await _team_or_404(request, team_id))


@router.patch(
    "/teams/{team_id}",
    summary="Rename, enable or disable a team",
    responses={404: _err("No such team."), 409: _err("Name taken.")},
)
async def update_team(team_id: TeamId, body: TeamUpdate, request: Request) -> TeamOut:
    team = await _call(request, _store(request).update_team, team_id, name=body.name, enabled=body.enabled)
    _changed(request)
    return TeamOut.of(team)


@router.delete(
    "/teams/{team_id}",
    summary="Delete a team and its keys (its usage history stays)",
    responses={404: _err("No such team.")},
)
async def delete_team(team_id: TeamId, request: Request) -> Deleted:
    await _call(request, _store(request).delete_team, team_id)
    _changed(request)
    return Deleted(id=team_id, object="team")


@router.put(
    "/teams/{team_id}/limits",
    summary="Replace a team's limits (omitted fields become unlimited)",
    responses={404: _err("No such team.")},
)
async def set_limits(team_id: TeamId, body: Limits, request: Request) -> Limits:
    team = await _call(request, _store(request).set_limits, team_id, body.to_limits())
    _changed(request)
    return Limits.of(team.limits)


@router.get("/teams/{team_id}/limits", summary="Get a team's limits", responses={404: _err("No such team.")})
async def get_limits(team_id: TeamId, request: Request) -> Limits:
    return Limits.of((await _team_or_404(request, team_id)).limits)


@router.get(
    "/teams/{team_id}/state",
    summary="Live counters and remaining budgets of a team",
    responses={404: _err("No such team.")},
)
async def team_state(team_id: TeamId, request: Request) -> TeamState:
    team = await _team_or_404(request, team_id)
    today = datetime.now(UTC).date()
    day, month_start = today.isoformat(), today.replace(day=1).isoformat()
    store = _store(request)
    spent_today = await _call(request, store.spent_tokens, team_id, day)
    spent_month = await _call(request, store.spent_tokens, team_id, month_start)
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
    backend = getattr(request.app.state, "state_backend", None)
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
async def create_team_key(team_id: TeamId, body: KeyCreate, request: Request) -> KeyCreated:
    secret, key = await _call(request, _store(request).create_key, team_id, body.name, expires_at=body.expiry())
    return KeyCreated(secret=secret, **KeyOut.of(key).model_dump())


@router.get("/teams/{team_id}/keys", summary="List a team's keys", responses={404: _err("No such team.")})
async def list_team_keys(team_id: TeamId, request: Request) -> KeyList:
    await _team_or_404(request, team_id)
    return KeyList(data=[KeyOut.of(k) for k in await _call(request, _store(request).list_keys, team_id)])


@router.post("/keys", status_code=201, summary="Create an admin key (no team; the secret is returned once)")
async def create_admin_key(body: KeyCreate, request: Request) -> KeyCreated:
    store = _store(request)
    secret, key = await _call(request, store.create_key, None, body.name, is_admin=True, expires_at=body.expiry())
    return KeyCreated(secret=secret, **KeyOut.of(key).model_dump())


@router.get("/keys", summary="List keys, of every team or of one")
async def list_keys(
    request: Request,
    team_id: str | None = Query(None, max_length=64, pattern=_ID, description="Only this team's keys. " + _ID_DOC),
) -> KeyList:
    return KeyList(data=[KeyOut.of(k) for k in await _call(request, _store(request).list_keys, team_id)])


@router.delete(
    "/keys/{key_id}",
    summary="Revoke a key (takes effect within ~1 s on every replica)",
    responses={404: _err("No such key.")},
)
async def revoke_key(key_id: KeyId, request: Request) -> KeyOut:
    key = await _call(request, _store(request).revoke_key, key_id)
    _changed(request)
    return KeyOut.of(key)


# --- usage ------------------------------------------------------------------------------------------------


@router.get("/usage", summary="Daily token usage per team and model")
async def usage(
    request: Request,
    team_id: str | None = Query(None, max_length=64, pattern=_ID, description="Only this team. " + _ID_DOC),
    since: date | None = Query(None, description="First UTC day, inclusive (YYYY-MM-DD)."),
    until: date | None = Query(None, description="Last UTC day, inclusive (YYYY-MM-DD)."),
) -> UsageList:
    if since is not None and until is not None and since > until:
        raise APIError(400, f"Invalid 'until': {until} is before since={since}.", "invalid_value", param="until")
    rows = await _call(
        request,
        _store(request).usage,
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
