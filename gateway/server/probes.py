"""Operator probes: liveness, readiness (which dependency is down) and Prometheus metrics.

`/livez` answers 200 while the process serves HTTP at all. `/health` (also `/readyz`) is readiness: 503 when the
gateway cannot admit requests (the shared state or the store unreachable, the event log failing its writes: `events`,
with why, or no pool with an instance whose circuit is closed), naming each check, so a load balancer sends traffic
elsewhere. Anyone may ask, so it says ok/down per pool only; with an admin key it also lists each instance (name,
address, circuit, requests in flight).
`/metrics` needs `Authorization: Bearer <metrics_token>` when the config sets one (it lists team ids and their
budgets).
"""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenweir.common.http.errors import APIError, error_response
from tokenweir.gateway.deps.callers import bearer_secret
from tokenweir.gateway.deps.services import ServicesDep
from tokenweir.gateway.state.backend import StateUnavailable
from tokenweir.gateway.store.db import DB_ERRORS

router = APIRouter()

_CHECK_TIMEOUT_S = 1.0
# Teams past this many get no per-team gauges of their own (a scrape must stay small).
MAX_TEAM_SERIES = 1000


@router.get("/livez", include_in_schema=False)
async def livez() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/health")
@router.get("/readyz", include_in_schema=False)
async def health(request: Request, services: ServicesDep) -> JSONResponse:
    detail = await _shows_admin_key(request, services)
    checks: dict[str, str] = {}
    admission = services.path.admission
    try:
        async with asyncio.timeout(_CHECK_TIMEOUT_S):
            await services.state.ping()
        checks["state"] = "ok" if admission.state_ready else "starting"
    except (StateUnavailable, TimeoutError):
        checks["state"] = "down"
    try:
        async with asyncio.timeout(_CHECK_TIMEOUT_S):
            await asyncio.to_thread(services.store.schema_versions)
        checks["store"] = "ok"
    except (*DB_ERRORS, TimeoutError):
        checks["store"] = "down"
    fault = services.events.faults.fault  # the write-ahead record of usage: nothing is admitted while it fails
    checks["events"] = "down" if fault is not None else "ok"
    pools = {}
    for name, pool in services.upstreams.pools.items():
        pools[name] = [
            {
                "instance": i.name,
                "base_url": i.cfg.base_url,
                "circuit": "open" if i.opened_at is not None else "closed",
                "down": i.down_since is not None,  # its process exited (a supervised engine), not yet back
                "in_flight": i.in_flight,
            }
            for i in pool.instances
        ]
        checks[f"pool:{name}"] = "ok" if any(i["circuit"] == "closed" for i in pools[name]) else "down"
    fail_open = admission.local is not None  # admits without the shared state
    not_ready = checks["store"] == "down" or checks["events"] == "down" or (checks["state"] != "ok" and not fail_open)
    not_ready = not_ready or (bool(pools) and all(checks[f"pool:{p}"] == "down" for p in pools))
    degraded = any(v != "ok" for v in checks.values())
    status = "unavailable" if not_ready else "degraded" if degraded else "ok"
    body: dict = {"status": status, "checks": checks} | ({"pools": pools} if detail else {})
    if fault is not None:  # why, and since when (the file's path is the operator's to see)
        why = {"error": fault.error, "failing_s": round(time.time() - fault.since, 3)}
        body["events"] = why | ({"path": str(services.events.path)} if detail else {})
    return JSONResponse(body, status_code=503 if not_ready else 200)


async def _shows_admin_key(request: Request, services: ServicesDep) -> bool:
    """Whether the caller sent an admin key: instance names, addresses and loads are the operator's to see, not
    every tenant's. No key, or a tenant's: the summary; a key that is not valid at all: a 401, as anywhere."""
    secret = bearer_secret(request)
    if not secret:
        return False
    return (await services.authenticator.authenticate(secret)).key.is_admin


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, services: ServicesDep) -> Response:
    m = services.metrics
    token = services.config.metrics_token
    if token:
        header = request.headers.get("authorization", "")
        if not hmac.compare_digest(header.encode(), f"Bearer {token}".encode()):
            return error_response(
                APIError(401, "Metrics need 'Authorization: Bearer <metrics_token>'.", "invalid_metrics_token")
            )
    teams = sorted(services.path.admission.seen_teams)[:MAX_TEAM_SERIES]
    for team_id in teams:
        try:
            m.refresh_team(team_id, await services.state.snapshot(team_id))
        except StateUnavailable:
            break  # the state is away: the gauges keep their last values; /health says why
    for model, queue in services.queues.items():
        m.queue_depth.labels(model).set(queue.stats()["queued"])
    return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
