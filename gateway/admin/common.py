"""What the admin route modules (gateway.admin.teams: teams and usage; gateway.admin.keys: keys) share: OpenAI-style
errors for bad input and for store failures, the route class that renders them, team lookup, auth cache refresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from tokenweir.common.http.errors import APIError, error_response
from tokenweir.common.http.validation import validation_error
from tokenweir.gateway.admin.models import ID_DOC, ID_PATTERN, PLAIN_TEXT_PATTERN, TEAM_NAME_PATTERN
from tokenweir.gateway.deps.services import Services
from tokenweir.gateway.openai.error_body import ErrorBody
from tokenweir.gateway.store.db import DB_ERRORS
from tokenweir.gateway.store.store import Conflict, NotFound, Store, Team

T = TypeVar("T")

# The admin API calls a value of the wrong type an invalid value, and words problems as pydantic does: as always.
_CODES = {"invalid_type": "invalid_value"}

# What a pattern means, for a validation error's message (the regex itself helps nobody).
_PATTERNS = {
    TEAM_NAME_PATTERN: "expected letters, digits, '.', '_' or '-', starting with a letter or digit",
    PLAIN_TEXT_PATTERN: "control characters are not allowed",
    ID_PATTERN: "expected an id of letters, digits, '.', '_' or '-'",
}


class OpenAIErrorRoute(APIRoute):
    """Renders request validation failures as OpenAI errors without needing a handler on the app."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return error_response(
                    validation_error(exc.errors(), codes=_CODES, patterns=_PATTERNS, pydantic_words=True)
                )
            except APIError as err:  # also from require_admin: the router works even on an app without the handler
                return error_response(err)
            except HTTPException as exc:  # FastAPI's own: a body it could not read (e.g. JSON nested too deep)
                if exc.status_code != 400:
                    raise
                return error_response(APIError(400, f"Invalid request body: {exc.detail}.", "invalid_json"))

        return route


def error_doc(description: str) -> dict:
    """An entry of a route's `responses`: the OpenAI error body, described."""
    return {"model": ErrorBody, "description": description}


TeamId = Annotated[str, Path(max_length=64, pattern=ID_PATTERN, description="The team's id. " + ID_DOC)]

# --- store calls ------------------------------------------------------------------------------------------


async def store_call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
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


def store_of(services: Services) -> Store:
    """The store: opened by the app's lifespan before any request (an app that mounts the admin router alone
    is given one)."""
    assert services.store is not None
    return services.store


def invalidate_auth_cache(services: Services) -> None:
    # This replica sees the change at once; the others within their cache TTL (<= 1 s).
    if services.authenticator is not None:
        services.authenticator.invalidate()


async def team_or_404(services: Services, team_id: str) -> Team:
    team = await store_call(store_of(services).get_team, team_id)
    if team is None:
        raise APIError(404, f"No such team: {team_id!r}.", "team_not_found", param="team_id")
    return team
