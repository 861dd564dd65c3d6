"""The gateway app: `create_app(config)` wires store, auth, state, queues, upstreams, events and metrics.

The lifespan opens what needs opening and, on shutdown (uvicorn runs it on SIGTERM too), drains: usage and
events are flushed before the process goes.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from datetime import UTC, datetime

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import relay
from gateway.admin import router as admin_router
from gateway.admission import Admission, new_request_id
from gateway.auth import Authenticator
from gateway.config import GatewayConfig
from gateway.dispatch_queue import DispatchQueue
from gateway.errors import APIError, api_error_handler, error_response
from gateway.events import EventWriter
from gateway.logging import bind_request, clear_request, get_logger
from gateway.metrics import Metrics
from gateway.routes import router, validation_error
from gateway.state import InMemoryState
from gateway.state_redis import RedisState
from gateway.store import Store
from gateway.upstream import Upstreams
from gateway.usage import UsageRecorder

log = get_logger()


def create_app(config: GatewayConfig, *, store: Store | None = None, state_backend=None) -> FastAPI:
    """An app for `config`. A `store` passed in stays open after shutdown (the caller owns it)."""
    upstreams = Upstreams(config)
    metrics = Metrics()
    own_state = state_backend is None
    state = state_backend or (RedisState(config.state_url) if config.state_url else InMemoryState())
    queues = {name: DispatchQueue(p.cfg.capacity, p.cfg.max_queued) for name, p in upstreams.pools.items()}
    events = EventWriter(
        config.events.path, config.events.max_bytes, config.events.backups, config.events.flush_interval_s
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        own_store = store is None
        st = store or await asyncio.to_thread(Store.open, config.store_url)
        usage = UsageRecorder(st, config.usage_flush_interval_s)
        client = relay.make_client(config.timeouts.connect_s)
        app.state.store = st
        app.state.authenticator = Authenticator(st, config.auth_cache_ttl_s)
        app.state.usage = usage
        app.state.http = client
        app.state.admission = Admission(config, upstreams, state, queues, client, events, metrics, usage)
        await seed_budgets(st, state)
        await asyncio.to_thread(app.state.admission.warm)
        await usage.start()
        await events.start()
        upstreams.start(client)
        log.info("gateway_started", pools=list(upstreams.pools), store=config.store_url if own_store else "given")
        try:
            yield
        finally:
            await relay.wait_background()  # requests cut at shutdown still abort, settle and write their event
            await upstreams.close()
            await usage.close()
            await events.close()
            await client.aclose()
            if own_state and hasattr(state, "close"):
                await state.close()
            if own_store:
                st.close()
            log.info("gateway_stopped")

    app = FastAPI(title="tokenweir gateway", version="0.1.0", lifespan=lifespan)
    app.state.config = config
    app.state.upstreams = upstreams
    app.state.metrics = metrics
    app.state.state_backend = state
    app.state.queues = queues
    app.state.events = events
    app.include_router(router)
    app.include_router(admin_router)
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_middleware(RequestMiddleware, max_body_bytes=config.max_body_bytes)
    return app


async def seed_budgets(store: Store, state) -> None:
    """Spend already recorded this UTC day / month, so a restart does not hand out fresh budgets."""
    now = datetime.now(UTC)
    day, month = now.strftime("%Y-%m-%d"), now.strftime("%Y-%m-01")

    def read() -> list[tuple[str, int, int]]:
        return [(t.id, store.spent_tokens(t.id, day), store.spent_tokens(t.id, month)) for t in store.list_teams()]

    for team_id, day_tokens, month_tokens in await asyncio.to_thread(read):
        if day_tokens or month_tokens:
            state.seed_spend(team_id, day_tokens, month_tokens)


INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions")


async def _api_error_handler(request: Request, err: APIError):
    record_unadmitted(request, err)
    return await api_error_handler(request, err)


def record_unadmitted(request: Request, err: APIError) -> None:
    """Every inference request ends as one JSONL event: those refused before admission got none from finish()."""
    if request.url.path in INFERENCE_PATHS and not getattr(request.state, "accounted", False):
        admission = getattr(request.app.state, "admission", None)
        if admission is not None:
            admission.record_unadmitted(request, err)


async def _validation_handler(_request, exc: RequestValidationError):
    return error_response(validation_error(exc.errors()))


async def _http_handler(_request, exc: StarletteHTTPException):
    codes = {404: "not_found", 405: "method_not_allowed"}
    message = "Unknown URL." if exc.status_code == 404 else str(exc.detail)
    return error_response(APIError(exc.status_code, message, codes.get(exc.status_code), headers=exc.headers))


class BodyTooLarge(Exception):
    pass


class RequestMiddleware:
    """Pure ASGI (cheap): request id in and out, the body size limit, and a last-resort OpenAI-shaped 500."""

    def __init__(self, app, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client_id = None
        length = None
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                client_id = v.decode("latin-1")
            elif k == b"content-length":
                length = int(v) if v.isdigit() else None
        request_id = new_request_id(client_id)
        state = scope.setdefault("state", {})
        state["request_id"], state["t0"] = request_id, time.perf_counter()
        rid_header = (b"x-request-id", request_id.encode())
        started = False
        bind_request(request_id=request_id)

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", ()), rid_header]
            await send(message)

        async def error(err: APIError) -> None:
            if "app" in scope:  # set by Starlette once the request reached the app
                record_unadmitted(Request(scope), err)
            body = orjson.dumps(err.body())
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send_with_id({"type": "http.response.start", "status": err.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        too_large = APIError(
            413,
            f"The request body is larger than the gateway's limit of {self.max_body_bytes} bytes.",
            "body_too_large",
        )
        if length is not None and length > self.max_body_bytes:
            clear_request()
            return await error(too_large)
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge
            return message

        try:
            await self.app(scope, counting_receive, send_with_id)
        except BodyTooLarge:
            if not started:
                await error(too_large)
        except Exception:
            log.exception("unhandled_error", path=scope.get("path"))
            if not started:
                await error(APIError(500, "The gateway hit an internal error; it has been logged.", "internal_error"))
        finally:
            clear_request()
