"""The app-wide services in one record: what `create_app` builds and its lifespan opens, reached by routes, the
admin API and the probes through one FastAPI dependency (`ServicesDep`), never as loose `app.state` attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends
from starlette.requests import HTTPConnection

if TYPE_CHECKING:
    from tokenweir.gateway.accounting.events import EventWriter
    from tokenweir.gateway.accounting.metrics import Metrics
    from tokenweir.gateway.accounting.usage import UsageRecorder
    from tokenweir.gateway.auth.authenticator import Authenticator
    from tokenweir.gateway.config import GatewayConfig
    from tokenweir.gateway.request.admission import Admission
    from tokenweir.gateway.request.queue import DispatchQueue
    from tokenweir.gateway.state.memory import StateBackend
    from tokenweir.gateway.state.outbox import StateOutbox
    from tokenweir.gateway.store.store import Store
    from tokenweir.gateway.upstream.http1 import HTTP1Pool
    from tokenweir.gateway.upstream.pools import Upstreams


@dataclass(slots=True, eq=False)
class Services:
    """Built by `create_app` (config to events), the rest opened by its lifespan (store to admission): a field is
    None until then. An app that mounts one router alone (the admin API in a test) fills in only what it uses."""

    config: GatewayConfig | None = None
    upstreams: Upstreams | None = None
    metrics: Metrics | None = None
    state: StateBackend | None = None  # the limits state: InMemoryState or RedisState
    queues: dict[str, DispatchQueue] = field(default_factory=dict)  # one per pool
    events: EventWriter | None = None
    store: Store | None = None
    authenticator: Authenticator | None = None
    usage: UsageRecorder | None = None
    http: HTTP1Pool | None = None  # the upstream client
    outbox: StateOutbox | None = None
    admission: Admission | None = None


def get_services(conn: HTTPConnection) -> Services:
    """FastAPI dependency: the app's services (the one place that reads app.state)."""
    return conn.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]
