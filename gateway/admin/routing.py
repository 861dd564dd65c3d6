"""Admin API, routing: pools, their members and aliases changed at run time, and the aliases' rollouts.

A change is checked against the table it makes and written in one store transaction (two that race are put in
line: the second is judged against the first's table, so no pair of changes leaves a name pointing nowhere),
applied on this replica at once and on every other within `routing_poll_interval_s` (gateway/upstream/
routing_sync.py). The config file's pools and aliases are the seed a stored entry overrides. Draining a member stops
new requests to it while those it serves finish; removing it takes it out of the table (requests already on it still
finish). A pool name may hold '/': the member routes are matched first.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.admin.common import OpenAIErrorRoute, error_doc, store_call, store_of
from tokenweir.gateway.admin.models import PLAIN_TEXT_PATTERN
from tokenweir.gateway.config import AliasConfig, PoolConfig, UpstreamConfig, member_key_env_error, routes_error
from tokenweir.gateway.deps.services import Services, ServicesDep
from tokenweir.gateway.runtime.routing_sync import Composed, alias_body, pool_body
from tokenweir.gateway.store.routing import RoutingEntry
from tokenweir.gateway.upstream.instance import CLOSED, HALF_OPEN, Instance
from tokenweir.gateway.upstream.pools import Pool, Routes
from tokenweir.policies.canary import PROMOTED, ROLLED_BACK, RolloutState

router = APIRouter(route_class=OpenAIErrorRoute)

ModelPath = Annotated[str, Path(min_length=1, max_length=256, description="The public model name.")]
MemberName = Annotated[str, Path(min_length=1, max_length=256, pattern=PLAIN_TEXT_PATTERN)]
_CIRCUITS = {CLOSED: "closed", HALF_OPEN: "half_open"}
_CONFLICT: dict[int | str, dict[str, Any]] = {409: error_doc("The change would leave a name pointing nowhere.")}


class MemberChange(BaseModel):
    """What may change on a member in place. Omitted: as it is."""

    model_config = ConfigDict(extra="forbid")

    draining: bool | None = Field(default=None, description="True: no new requests; those it serves finish.")
    revision: str | None = Field(default=None, max_length=256, pattern=PLAIN_TEXT_PATTERN)
    model: str | None = Field(default=None, max_length=256, pattern=PLAIN_TEXT_PATTERN)
    api_key_env: str | None = Field(
        default=None,
        max_length=256,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="An env variable marked as a member's key: TOKENWEIR_MEMBER_KEY_<NAME>, TOKENWEIR_ENGINE_API_KEY, "
        "or one the config lists in api_key_envs.",
    )


# --- reads ----------------------------------------------------------------------------------------------------


def member_out(inst: Instance) -> dict:
    circuit = "down" if inst.down_since is not None else _CIRCUITS.get(inst.circuit, "open")
    return {
        "name": inst.name,
        "base_url": inst.cfg.base_url,
        "role": inst.cfg.role,
        "engine": inst.cfg.engine,
        "draining": inst.cfg.draining,
        "circuit": circuit,
        "in_flight": inst.in_flight,  # on this replica
        "revision": inst.revision,
        "max_model_len": inst.max_model_len,
    }


def pool_out(services: Services, pool: Pool, routes: Routes | None = None) -> dict:
    routes = routes or services.upstreams.routes
    queue = services.queues.get(pool.model)
    return {
        "object": "pool",
        "model": pool.model,
        "source": "store" if ("pool", pool.model) in routes.entry_versions else "config",
        "routing_version": routes.version,
        "config": pool_body(services.routing.declared_pool(pool.model) or pool.cfg),  # as written: not discovered
        "members": [member_out(i) for i in pool.instances],
        "queue": None if queue is None else {k: queue.stats()[k] for k in ("capacity", "in_use", "queued")},
    }


def alias_out(services: Services, alias: AliasConfig, routes: Routes | None = None) -> dict:
    routes = routes or services.upstreams.routes
    serving = routes.aliases[alias.model]
    out: dict[str, Any] = {
        "object": "alias",
        "model": alias.model,
        "source": "store" if ("alias", alias.model) in routes.entry_versions else "config",
        "routing_version": routes.version,
        "config": dataclasses.asdict(alias),
        "weights": {v.name: v.weight for v in serving.variants},
        "rollout": None,
    }
    if alias.rollout is not None:
        state = routes.rollouts.get(alias.model) or RolloutState()
        canary, baseline = services.rollouts.summaries(alias)
        out["rollout"] = {
            **state.to_dict(),
            "canary_share": state.canary_share(alias.rollout.steps),
            "windows": {alias.rollout.canary: canary.to_dict(), alias.rollout.baseline: baseline.to_dict()},
        }
    return out


def written_routes(services: Services, model: str, version: int, table: Composed) -> Routes:
    """The table a change of `model` wrote (at `version`), for its answer when a later change, another writer's, has
    already taken the name out here: the write stands, whatever came after it. Its pool `model` has no state yet."""
    pools = {
        p.model: Pool(p, [Instance(u, services.config.breaker) for u in p.upstreams])
        for p in table.pools
        if p.model == model
    }
    return Routes(
        pools,
        {a.model: a for a in table.aliases},
        version,
        declared={a.model: a for a in table.declared},
        rollouts=table.rollouts,
        entry_versions=table.entry_versions,
    )


def pool_written(services: Services, model: str, written: tuple[int, Composed]) -> dict:
    """A written pool as this replica serves it now, else as written (`written_routes`)."""
    if (pool := services.upstreams.pools.get(model)) is not None:
        return pool_out(services, pool)
    routes = written_routes(services, model, *written)
    return pool_out(services, routes.pools[model], routes)


def alias_written(services: Services, model: str, written: tuple[int, Composed]) -> dict:
    """A written alias as this replica serves it now, else as written (`written_routes`)."""
    if (alias := services.upstreams.routes.declared.get(model)) is not None:
        return alias_out(services, alias)
    routes = written_routes(services, model, *written)
    return alias_out(services, routes.declared[model], routes)


def pool_or_404(services: Services, model: str) -> Pool:
    pool = services.upstreams.pools.get(model)
    if pool is None:
        raise APIError(404, f"No such pool: {model!r}.", "pool_not_found", param="model")
    return pool


def alias_or_404(services: Services, model: str) -> AliasConfig:
    alias = services.upstreams.routes.declared.get(model)
    if alias is None:
        raise APIError(404, f"No such alias: {model!r}.", "alias_not_found", param="model")
    return alias


@router.get("/pools", summary="List pools (config file and run-time), their members and state on this replica")
async def list_pools(services: ServicesDep) -> dict:
    return {"object": "list", "data": [pool_out(services, p) for p in services.upstreams.pools.values()]}


@router.get("/aliases", summary="List aliases, their weights now and their rollouts")
async def list_aliases(services: ServicesDep) -> dict:
    declared = services.upstreams.routes.declared.values()
    return {"object": "list", "data": [alias_out(services, a) for a in declared]}


@router.get("/rollouts", summary="Aliases with a rollout: state, canary share and this replica's windows")
async def list_rollouts(services: ServicesDep) -> dict:
    declared = [a for a in services.upstreams.routes.declared.values() if a.rollout is not None]
    return {"object": "list", "data": [alias_out(services, a) for a in declared]}


# --- writes ---------------------------------------------------------------------------------------------------


async def change(
    services: Services, kind: str, name: str, make: Callable[[Composed], dict | None]
) -> tuple[int, Composed]:
    """Write the entry `make` builds from the table as stored (None: remove the name), if the table it makes is
    whole; returns the routing version written and that table. The store reads the table, calls `make` and writes in
    one transaction no other routing write enters, so two writers that race are put in line and the second is judged
    against the table the first made."""
    sync = services.routing
    made: list[Composed] = []

    def build(entries: list[RoutingEntry]) -> dict | None:
        body = make(sync.composed(entries))
        after = sync.composed([e for e in entries if (e.kind, e.name) != (kind, name)] + [
            RoutingEntry(kind, name, body, 0, "")
        ])  # fmt: skip
        if (error := routes_error(after.pools, after.aliases)) is not None:
            raise APIError(409, f"{error}.", "routing_conflict")
        made.append(after)
        return body

    version = await store_call(store_of(services).change_routing, kind, name, build)
    await sync.refresh(force=True)
    return version, made[-1]


def stored_pool(composed: Composed, model: str) -> PoolConfig:
    pool = next((p for p in composed.pools if p.model == model), None)
    if pool is None:
        raise APIError(404, f"No such pool: {model!r}.", "pool_not_found", param="model")
    return pool


def check_same_model(in_body: str, in_path: str) -> None:
    if in_body != in_path:
        raise APIError(400, f"The body's model {in_body!r} is not the path's {in_path!r}.", "invalid_value", "model")


def check_keys(upstreams: list[UpstreamConfig], listed: list[str]) -> None:
    """Members' keys come from env variables marked as members' keys (`listed`: the config's api_key_envs), never in
    the body, and never from another of the gateway's variables: its value would be sent to the member's address."""
    for u in upstreams:
        if u.api_key is not None:
            raise APIError(
                400,
                "A member's api_key is not stored: put the key in an env variable on every replica and name it with "
                "api_key_env.",
                "invalid_value",
                param="api_key",
            )
        if u.api_key_env and (error := member_key_env_error(u.api_key_env, listed)) is not None:
            raise APIError(400, f"{error[0].upper()}{error[1:]}.", "invalid_value", param="api_key_env")
        if u.api_key_env and not os.environ.get(u.api_key_env):
            raise APIError(
                400, f"api_key_env {u.api_key_env} is not set on this replica.", "invalid_value", "api_key_env"
            )


@router.post("/pools/{model:path}/members", status_code=201, summary="Add a member", responses=_CONFLICT)
async def add_member(model: ModelPath, body: UpstreamConfig, services: ServicesDep) -> dict:
    check_keys([body], services.config.api_key_envs)

    def make(composed: Composed) -> dict:
        pool = stored_pool(composed, model)
        body.name = body.name or f"{model}-{len(pool.upstreams)}"
        if any(u.name == body.name for u in pool.upstreams):
            raise APIError(409, f"Pool {model!r} has a member named {body.name!r}.", "duplicate_member", "name")
        return pool_body(dataclasses.replace(pool, upstreams=[*pool.upstreams, body]))

    return pool_written(services, model, await change(services, "pool", model, make))


def _member_index(pool: PoolConfig, name: str) -> int:
    for i, u in enumerate(pool.upstreams):
        if u.name == name:
            return i
    raise APIError(404, f"Pool {pool.model!r} has no member {name!r}.", "member_not_found", param="name")


@router.patch("/pools/{model:path}/members/{name}", summary="Change or drain a member", responses=_CONFLICT)
async def change_member(model: ModelPath, name: MemberName, body: MemberChange, services: ServicesDep) -> dict:
    changes = body.model_dump(exclude_unset=True)
    if changes.get("draining") is None:
        changes.pop("draining", None)

    def make(composed: Composed) -> dict:
        pool = stored_pool(composed, model)
        upstreams = list(pool.upstreams)
        i = _member_index(pool, name)
        upstreams[i] = dataclasses.replace(upstreams[i], **changes)
        check_keys([dataclasses.replace(upstreams[i], api_key=None)], services.config.api_key_envs)
        return pool_body(dataclasses.replace(pool, upstreams=upstreams))

    return pool_written(services, model, await change(services, "pool", model, make))


@router.delete("/pools/{model:path}/members/{name}", summary="Remove a member (drain it first)", responses=_CONFLICT)
async def remove_member(model: ModelPath, name: MemberName, services: ServicesDep) -> dict:
    def make(composed: Composed) -> dict:
        pool = stored_pool(composed, model)
        i = _member_index(pool, name)
        return pool_body(dataclasses.replace(pool, upstreams=pool.upstreams[:i] + pool.upstreams[i + 1 :]))

    return pool_written(services, model, await change(services, "pool", model, make))


@router.get("/pools/{model:path}", summary="Get a pool", responses={404: error_doc("No such pool.")})
async def get_pool(model: ModelPath, services: ServicesDep) -> dict:
    return pool_out(services, pool_or_404(services, model))


@router.put("/pools/{model:path}", summary="Create or replace a pool", responses=_CONFLICT)
async def put_pool(model: ModelPath, body: PoolConfig, services: ServicesDep) -> dict:
    check_same_model(body.model, model)
    check_keys(body.upstreams, services.config.api_key_envs)
    return pool_written(services, model, await change(services, "pool", model, lambda _: pool_body(body)))


@router.delete("/pools/{model:path}", summary="Remove a pool (requests in flight finish)", responses=_CONFLICT)
async def delete_pool(model: ModelPath, services: ServicesDep) -> dict:
    def make(composed: Composed) -> None:
        stored_pool(composed, model)

    await change(services, "pool", model, make)
    return {"id": model, "object": "pool", "deleted": True}


@router.get("/aliases/{model:path}", summary="Get an alias", responses={404: error_doc("No such alias.")})
async def get_alias(model: ModelPath, services: ServicesDep) -> dict:
    return alias_out(services, alias_or_404(services, model))


@router.put("/aliases/{model:path}", summary="Create or replace an alias (a rollout starts over)", responses=_CONFLICT)
async def put_alias(model: ModelPath, body: AliasConfig, services: ServicesDep) -> dict:
    check_same_model(body.model, model)
    state = RolloutState(since=time.time()) if body.rollout is not None else None
    return alias_written(services, model, await change(services, "alias", model, lambda _: alias_body(body, state)))


@router.delete("/aliases/{model:path}", summary="Remove an alias", responses=_CONFLICT)
async def delete_alias(model: ModelPath, services: ServicesDep) -> dict:
    def make(composed: Composed) -> None:
        if not any(a.model == model for a in composed.declared):
            raise APIError(404, f"No such alias: {model!r}.", "alias_not_found", param="model")

    await change(services, "alias", model, make)
    return {"id": model, "object": "alias", "deleted": True}


async def _decide(services: Services, model: str, status: str) -> dict:
    def make(composed: Composed) -> dict:
        alias = next((a for a in composed.declared if a.model == model), None)
        if alias is None or alias.rollout is None:
            raise APIError(404, f"No rollout on an alias {model!r}.", "rollout_not_found", param="model")
        state = composed.rollouts.get(model) or RolloutState()
        return alias_body(alias, dataclasses.replace(state, status=status, since=time.time(), reason="by an operator"))

    return alias_written(services, model, await change(services, "alias", model, make))


@router.post("/rollouts/{model:path}/rollback", summary="Roll a canary back now (its share goes to 0)")
async def rollback(model: ModelPath, services: ServicesDep) -> dict:
    return await _decide(services, model, ROLLED_BACK)


@router.post("/rollouts/{model:path}/promote", summary="Promote a canary now (its share goes to 100%)")
async def promote(model: ModelPath, services: ServicesDep) -> dict:
    return await _decide(services, model, PROMOTED)
