"""The inference endpoints' own lane: a POST to /v1/chat/completions, /v1/completions, /v1/embeddings or /v1/responses
goes from the server straight to its handler, past FastAPI's router, dependency solver and middleware stack.

Why: those layers (Starlette's error and exception middleware, FastAPI's body-limit, telemetry and exit-stack
middleware, route matching, solving `require_key` and `ServicesDep`) cost more CPU per request than admission and
settling together, for a path that needs none of them. The lane does what they did for these routes, in order, by
plain calls: the request id, the body bound and the last-resort 500 (RequestMiddleware, as on every route), the key
(`require_key`), the body (`inference_response`, the same function the FastAPI routes call), and an APIError
answered by the app's own handler (so a refusal writes its event as anywhere else).

The FastAPI routes stay mounted at the same paths: they are what the OpenAPI document describes, and what answers
every other method there (405) or a path the lane does not take verbatim (404).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.deps.callers import require_key
from tokenweir.gateway.deps.services import Services
from tokenweir.gateway.openai.endpoints import PATH_KINDS
from tokenweir.gateway.server.responses_create import create_response
from tokenweir.gateway.server.routes import inference_response

ErrorHandler = Callable[[Request, APIError], Awaitable[Any]]


class InferenceLane:
    """The handler behind RequestMiddleware for the inference POSTs (see the module docstring)."""

    def __init__(self, app: FastAPI, on_error: ErrorHandler) -> None:
        self.app, self.on_error = app, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        services: Services = self.app.state.services
        try:
            principal = await require_key(request, services)
            kind = PATH_KINDS[scope["path"]]
            if kind == "responses":  # translated into a chat first (gateway/server/responses_create.py)
                response = await create_response(request, services, principal)
            else:
                response = await inference_response(request, services, principal, kind)
        except APIError as err:
            response = await self.on_error(request, err)
        await response(scope, receive, send)


class GatewayApp(FastAPI):
    """FastAPI, with the inference POSTs handed to `lane` (an ASGI app: RequestMiddleware around an InferenceLane,
    set by create_app) before Starlette's stack sees them."""

    lane: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane = self.lane
        if lane is not None and scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in PATH_KINDS:
            scope["app"] = self  # as Starlette sets it: the request reached the app
            return await lane(scope, receive, send)
        await super().__call__(scope, receive, send)
