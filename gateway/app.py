"""The gateway app: `create_app(config)` wires store, auth, state, queues, upstreams, events and metrics.

The lifespan opens what needs opening, each close pushed on an exit stack right after its open, builds the request
path's stages (gateway/deps/request_path.py) and the app's `Services` whole (gateway/deps/services.py). On shutdown
(uvicorn runs it on SIGTERM too) the stack unwinds in reverse: first the requests cut at shutdown settle (their
background tasks), then the pollers stop, then usage and events are flushed, then the connections close. What it does
before serving (replaying usage a crash kept out of the store, seeding the budgets) is gateway/startup.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tokenweir.common.http.errors import APIError, api_error_handler, error_response
from tokenweir.common.http.request_id import request_id_from
from tokenweir.common.http.validation import validation_error
from tokenweir.common.logging import bind_request, clear_request, ensure_configured, get_logger
from tokenweir.gateway.accounting.events import EventWriter
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.accounting.usage import UsageRecorder
from tokenweir.gateway.admin.teams import router as admin_router
from tokenweir.gateway.auth.authenticator import Authenticator
from tokenweir.gateway.batches.service import BatchService
from tokenweir.gateway.config import GatewayConfig, config_digest
from tokenweir.gateway.deps.request_path import RequestPath
from tokenweir.gateway.deps.services import Services, services_of
from tokenweir.gateway.openai.endpoints import PATH_KINDS
from tokenweir.gateway.request.background import BackgroundTasks
from tokenweir.gateway.request.context import open_scope, request_scope
from tokenweir.gateway.request.inflight import Recovery
from tokenweir.gateway.request.queue import DispatchQueue
from tokenweir.gateway.runtime.rollouts import Rollouts
from tokenweir.gateway.runtime.routing_sync import RoutingSync
from tokenweir.gateway.server.batches import router as batches_router
from tokenweir.gateway.server.files import router as files_router
from tokenweir.gateway.server.lane import GatewayApp, InferenceLane
from tokenweir.gateway.server.probes import router as probes_router
from tokenweir.gateway.server.responses import router as responses_router
from tokenweir.gateway.server.routes import router
from tokenweir.gateway.startup import replay_usage, seed_state
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.state.outbox import StateOutbox
from tokenweir.gateway.state.redis import RedisState
from tokenweir.gateway.store.db import DB_ERRORS
from tokenweir.gateway.store.store import Store
from tokenweir.gateway.upstream import calls
from tokenweir.gateway.upstream.discovery import Discovery
from tokenweir.gateway.upstream.pools import Upstreams
from tokenweir.gateway.upstream.shared_index import SharedPrefixIndex

log = get_logger()


def create_app(
    config: GatewayConfig,
    *,
    store: Store | None = None,
    state_backend=None,
    on_started: Callable[[Services], None] | None = None,
) -> FastAPI:
    """An app for `config`. A `store` passed in stays open after shutdown (the caller owns it). `on_started` sees the
    app's services once the lifespan has built them, before the first request (serve's engine replicas attach so)."""
    ensure_configured(config.log_level)
    metrics = Metrics()
    metrics.config_applied(config_digest(config), time.time())
    upstreams = Upstreams(config, metrics)
    own_state = state_backend is None
    state = state_backend or make_state(config)
    queues = {name: DispatchQueue(p.cfg.capacity, p.cfg.max_queued) for name, p in upstreams.pools.items()}
    events = EventWriter(
        config.events.path, config.events.max_bytes, config.events.backups, config.events.flush_interval_s
    )
    metrics.watch_events(events.faults)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Each resource's close is pushed right after it opens, so shutdown closes them in the reverse order.
        async with contextlib.AsyncExitStack() as opened:
            if own_state and hasattr(state, "close"):
                opened.push_async_callback(state.close)
            st = store
            if st is None:
                st = await asyncio.to_thread(Store.open, config.store_url)
                opened.callback(st.close)
            writer = config.events.writer_id or f"{socket.gethostname()}:{Path(config.events.path).resolve()}"
            usage = UsageRecorder(st, config.usage_flush_interval_s, writer=writer)
            client = calls.make_client(config.timeouts.connect_s)
            opened.push_async_callback(client.aclose)
            outbox = StateOutbox(state, Path(config.events.path).with_suffix(".outbox.jsonl"))
            background = BackgroundTasks()
            discovery = Discovery(config.discovery)
            routing = RoutingSync(
                upstreams, st, config.pools, config.aliases, discovery, api_key_envs=config.api_key_envs
            )
            rollouts = Rollouts(
                upstreams, st, routing, metrics, Path(config.events.path).with_suffix(".rollouts.jsonl")
            )
            path = RequestPath(
                config, upstreams, state, queues, client, events, metrics, usage, outbox, background, rollouts
            )
            opened.push_async_callback(path.close)
            app.state.services = services = Services(
                config=config,
                upstreams=upstreams,
                metrics=metrics,
                state=state,
                queues=queues,
                events=events,
                store=st,
                authenticator=Authenticator(st, config.auth_cache_ttl_s),
                usage=usage,
                http=client,
                outbox=outbox,
                path=path,
                background=background,
                routing=routing,
                rollouts=rollouts,
                # its runner's lease owner: this process's writer id (gateway/batches/runner.py)
                batches=BatchService.for_replica(st, config, path.admission, path.settler, queues, metrics, writer),
            )
            if on_started is not None:
                on_started(services)
            billed = await replay_usage(st, usage, events, config)
            await events.start()
            opened.push_async_callback(events.close)
            # Requests a killed run of this process left in flight: billed and given back before anything is served
            # (and before the in-process state's budgets are seeded from the store, which then includes them).
            if await Recovery(path.journal, path.settler, state, outbox, client, upstreams).run(billed):
                await usage.flush()
            await asyncio.to_thread(st.prune_settled, writer)  # billed directly: no start-up needs them any more
            await asyncio.to_thread(path.counters.warm)
            await usage.start()
            opened.push_async_callback(usage.close)
            await outbox.start()
            opened.push_async_callback(outbox.close)
            seeding = await seed_state(st, state, path.admission, usage, config)
            if seeding is not None:
                opened.push_async_callback(_cancel, seeding)
            upstreams.start(client)
            opened.push_async_callback(upstreams.close)
            if isinstance(state, RedisState) and config.prefix_index_sync_s > 0:
                shared_index = SharedPrefixIndex(state.client, state.keys.prefix, lambda: upstreams.pools)
                upstreams.on_record = shared_index.publish
                shared_index.poll.start(config.prefix_index_sync_s)
                opened.push_async_callback(shared_index.poll.close)
            with contextlib.suppress(*DB_ERRORS):  # the store away: the config's table until it answers
                await routing.refresh(force=True)
            routing.poll.start(config.routing_poll_interval_s)
            opened.push_async_callback(routing.poll.close)
            await routing.rediscover()  # members found by DNS: their addresses before the first request
            routing.discover.start(config.discovery.interval_s)
            opened.push_async_callback(routing.discover.close)
            rollouts.judge.start(config.routing_poll_interval_s)
            opened.push_async_callback(rollouts.judge.close)
            # First at shutdown: the requests cut at shutdown still abort, settle and write their event.
            opened.push_async_callback(background.wait)
            # Batches start once everything above serves, and stop first: their running lines end within the grace
            await opened.enter_async_context(services.batches)
            log.info(
                "gateway_started", pools=list(upstreams.pools), store=config.store_url if store is None else "given"
            )
            yield
        log.info("gateway_stopped")

    app = GatewayApp(title="tokenweir gateway", version="0.1.0", lifespan=lifespan)
    for routes in (probes_router, router, responses_router, admin_router, files_router, batches_router):
        app.include_router(routes)
    # Starlette types a handler as taking any Exception, though it calls each with its own class (starlette#2417)
    app.add_exception_handler(APIError, _api_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_handler)  # type: ignore[arg-type]
    app.add_middleware(
        RequestMiddleware, max_body_bytes=config.max_body_bytes, upload_bytes=config.batches.max_file_bytes
    )
    app.lane = RequestMiddleware(InferenceLane(app, _api_error_handler), max_body_bytes=config.max_body_bytes)
    return app


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def make_state(config: GatewayConfig):
    if not config.state_url:
        return InMemoryState()
    sc = config.state
    return RedisState(
        config.state_url,
        lease_s=sc.lease_s,
        # a hold outlives the longest request, so it is never reaped while its request still runs
        hold_s=sc.hold_s or max(900.0, config.timeouts.queue_s + config.timeouts.total_s + 60.0),
        max_connections=sc.max_connections,
        pool_timeout_s=sc.pool_timeout_s,
        timeout_s=sc.timeout_s,
        cluster=sc.cluster,
    )


CLIENT_GONE = APIError(499, "The client closed the connection before the request was read.", "client_disconnected")
SHUTTING_DOWN = APIError(503, "The gateway is shutting down; retry.", "shutting_down", headers={"retry-after": "1"})


async def _api_error_handler(request: Request, err: APIError):
    finish_unadmitted(request, err)
    return await api_error_handler(request, err)


def finish_unadmitted(request: Request, err: APIError) -> None:
    """Every inference request ends as one JSONL event. An admitted one's end is its RequestEnd's
    (gateway/request/request_end.py); this is the other end, of one refused before admission (reached from the
    error handler and the middleware: nothing was taken, only its event is written)."""
    kind = PATH_KINDS.get(request.url.path)
    scope = request_scope(request)
    if kind is not None and not scope.accounted:
        services_of(request).path.settler.finish_unadmitted(scope, kind, err)


async def _validation_handler(_request, exc: RequestValidationError):
    return error_response(validation_error(exc.errors()))


async def _http_handler(_request, exc: StarletteHTTPException):
    codes = {404: "not_found", 405: "method_not_allowed"}
    message = "Unknown URL." if exc.status_code == 404 else str(exc.detail)
    return error_response(APIError(exc.status_code, message, codes.get(exc.status_code), headers=exc.headers))


UPLOAD_PATH = "/v1/files"


class BodyTooLarge(Exception):
    pass


class RequestMiddleware:
    """Pure ASGI (cheap): request id in and out, the body size limit, and a last-resort OpenAI-shaped 500."""

    def __init__(self, app, max_body_bytes: int, upload_bytes: int | None = None) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self.upload_bytes = upload_bytes  # /v1/files uploads' own bound (batches.max_file_bytes)

    def body_limit(self, path: str) -> tuple[int, APIError]:
        """The largest body `path` takes, and the 413 over it."""
        if path == UPLOAD_PATH and self.upload_bytes is not None:
            limit, what, code = self.upload_bytes, "file upload", "file_too_large"
        else:
            limit, what, code = self.max_body_bytes, "request body", "body_too_large"
        return limit, APIError(413, f"The {what} is larger than the gateway's limit of {limit} bytes.", code)

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
        request_id = request_id_from(client_id)
        open_scope(scope, request_id)
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
                finish_unadmitted(Request(scope), err)
            body = orjson.dumps(err.body())
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
            await send_with_id({"type": "http.response.start", "status": err.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        max_body_bytes, too_large = self.body_limit(scope["path"])
        if length is not None and length > max_body_bytes:
            clear_request()
            return await error(too_large)
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_body_bytes:
                    raise BodyTooLarge
            return message

        try:
            await self.app(scope, counting_receive, send_with_id)
        except BodyTooLarge:
            if not started:
                await error(too_large)
        except ClientDisconnect:  # gone while we read its body: nothing to answer, one event to write
            if "app" in scope:
                finish_unadmitted(Request(scope), CLIENT_GONE)
        except asyncio.CancelledError:
            # The server is shutting down past its grace: a proper OpenAI error, never uvicorn's plain-text 500.
            if not started:
                with contextlib.suppress(Exception):
                    await error(SHUTTING_DOWN)
            raise
        except Exception:
            log.exception("unhandled_error", path=scope.get("path"))
            if not started:
                await error(APIError(500, "The gateway hit an internal error; it has been logged.", "internal_error"))
        finally:
            clear_request()
