"""The engine's FastAPI app over a running AsyncEngine: lifespan, request ids, error handlers and the routes."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenweir.common.http.request_id import request_id_from
from tokenweir.engine.api.auth import ApiKeyMiddleware
from tokenweir.engine.api.errors import add_error_handlers
from tokenweir.engine.api.routes import router
from tokenweir.engine.api.tracing import TracingMiddleware
from tokenweir.engine.core.async_engine import AsyncEngine
from tokenweir.engine.tool_parsers import tool_parser

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


def build_app(
    async_engine: AsyncEngine,
    api_key: str | None = None,
    tracer_provider: TracerProvider | None = None,
    tool_call_parser: str | None = "hermes",
) -> FastAPI:
    """Under uvicorn, the lifespan starts and stops the engine loop; a test driving the app through
    httpx.ASGITransport (no lifespan) calls `async_engine.start()` itself. With `api_key`, every route but /health
    and /metrics needs it as a bearer key (engine/api/auth.py). With a `tracer_provider`, generation requests are
    traced (engine/api/tracing.py); without, tracing is off. `tool_call_parser` (engine/tool_parsers; None or "none":
    no calls the model chooses) reads the calls of chats whose tool_choice is "auto"."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        started_here = not async_engine.started
        if started_here:
            async_engine.start()
        yield
        if started_here:
            async_engine.stop()

    app = FastAPI(title="tokenweir engine", lifespan=lifespan)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if tracer_provider is not None:
        app.add_middleware(TracingMiddleware, tracer_provider=tracer_provider)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so a refused request still gets its id
    app.state.async_engine = async_engine  # what the routes' `Engine` dependency reads
    app.state.tool_parser = tool_parser(tool_call_parser)
    add_error_handlers(app)
    app.include_router(router)
    return app


class RequestIdMiddleware:
    """Takes a sane `X-Request-Id` (the gateway's rule, common/http/request_id.py; else makes a uuid), stores it in
    scope state and echoes it on the response; the engine runs the request under that id, so POST /abort can name it.
    Pure ASGI on purpose: BaseHTTPMiddleware would sit between a stream and its disconnect."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = request_id_from(given, prefix="")
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)
