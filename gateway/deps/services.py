"""The app-wide services in one record: built whole by the app's lifespan once everything is open, reached by
routes, the admin API and the probes through one FastAPI dependency (`ServicesDep`), never as loose `app.state`
attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends
from starlette.requests import HTTPConnection

if TYPE_CHECKING:
    from tokenweir.gateway.accounting.events import EventWriter
    from tokenweir.gateway.accounting.metrics import Metrics
    from tokenweir.gateway.accounting.usage import UsageRecorder
    from tokenweir.gateway.auth.authenticator import Authenticator
    from tokenweir.gateway.batches.service import BatchService
    from tokenweir.gateway.config import GatewayConfig
    from tokenweir.gateway.deps.request_path import RequestPath
    from tokenweir.gateway.request.background import BackgroundTasks
    from tokenweir.gateway.request.queue import DispatchQueue
    from tokenweir.gateway.runtime.rollouts import Rollouts
    from tokenweir.gateway.runtime.routing_sync import RoutingSync
    from tokenweir.gateway.state.backend import StateBackend
    from tokenweir.gateway.state.outbox import StateOutbox
    from tokenweir.gateway.store.store import Store
    from tokenweir.gateway.upstream.client import UpstreamClient
    from tokenweir.gateway.upstream.pools import Upstreams


@dataclass(slots=True, eq=False)
class Services:
    """Everything a request may reach, built whole by the lifespan (gateway/app.py) before the first request."""

    config: GatewayConfig
    upstreams: Upstreams
    metrics: Metrics
    state: StateBackend  # the limits state: InMemoryState or RedisState
    queues: dict[str, DispatchQueue]  # one per pool
    events: EventWriter
    store: Store
    authenticator: Authenticator
    usage: UsageRecorder
    http: UpstreamClient  # the upstream client
    outbox: StateOutbox
    path: RequestPath  # the request path's stages: admission, dispatch, settle, and what they share
    background: BackgroundTasks  # what cancelled requests still run (their settle): shutdown waits for it
    routing: RoutingSync  # runtime pools and aliases: the store's, applied here
    rollouts: Rollouts  # aliases' canaries judged on this replica's traffic
    batches: BatchService  # /v1/files and /v1/batches; its runner runs batches' lines through `path`

    @classmethod
    def partial(cls, **given: Any) -> Services:
        """A record with only `given` set and every other field None, though typed otherwise: for a test app that
        mounts one router alone and gives it what that router reads. Never what serves requests."""
        services = cls.__new__(cls)
        for f in fields(cls):
            setattr(services, f.name, given.pop(f.name, None))
        assert not given, f"no such services: {sorted(given)}"
        return services


def services_of(conn: HTTPConnection) -> Services:
    """The app's services (the one place that reads app.state)."""
    return conn.app.state.services


async def get_services(conn: HTTPConnection) -> Services:
    """FastAPI dependency: `services_of`. Async because FastAPI runs a sync dependency in its thread pool: a thread
    hop on every request for one attribute read."""
    return conn.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]
