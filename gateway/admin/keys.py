"""Admin API, keys: create team and admin keys, list and revoke them, and a key's own limits.

gateway.admin.teams includes this router under its own (/admin, admin key required, OpenAI-style errors).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.admin.common import (
    OpenAIErrorRoute,
    TeamId,
    error_doc,
    invalidate_auth_cache,
    store_call,
    store_of,
    team_or_404,
)
from tokenweir.gateway.admin.models import (
    ID_DOC,
    ID_PATTERN,
    KeyCreate,
    KeyCreated,
    KeyLimitsBody,
    KeyList,
    KeyOut,
    KeyUpdate,
)
from tokenweir.gateway.deps.services import Services, ServicesDep

KeyId = Annotated[str, Path(max_length=64, pattern=ID_PATTERN, description="The key's id. " + ID_DOC)]

router = APIRouter(route_class=OpenAIErrorRoute)


@router.post(
    "/teams/{team_id}/keys",
    status_code=201,
    summary="Create an API key for a team (the secret is returned once)",
    responses={404: error_doc("No such team.")},
)
async def create_team_key(team_id: TeamId, body: KeyCreate, services: ServicesDep) -> KeyCreated:
    limits = body.limits.to_limits() if body.limits is not None else None
    store = store_of(services)
    secret, key = await store_call(
        store.create_key,
        team_id,
        body.name,
        expires_at=body.expiry(),
        limits=limits,
        may_pick_variant=body.may_pick_variant,
    )
    return KeyCreated(secret=secret, **KeyOut.of(key).model_dump())


@router.get("/teams/{team_id}/keys", summary="List a team's keys", responses={404: error_doc("No such team.")})
async def list_team_keys(team_id: TeamId, services: ServicesDep) -> KeyList:
    await team_or_404(services, team_id)
    return KeyList(data=[KeyOut.of(k) for k in await store_call(store_of(services).list_keys, team_id)])


@router.post("/keys", status_code=201, summary="Create an admin key (no team; the secret is returned once)")
async def create_admin_key(body: KeyCreate, services: ServicesDep) -> KeyCreated:
    if body.limits is not None:
        raise _admin_key_limits()
    if body.may_pick_variant:
        raise _admin_key_variants()
    store = store_of(services)
    secret, key = await store_call(store.create_key, None, body.name, is_admin=True, expires_at=body.expiry())
    return KeyCreated(secret=secret, **KeyOut.of(key).model_dump())


@router.get("/keys", summary="List keys, of every team or of one")
async def list_keys(
    services: ServicesDep,
    team_id: str | None = Query(
        None, max_length=64, pattern=ID_PATTERN, description="Only this team's keys. " + ID_DOC
    ),
) -> KeyList:
    return KeyList(data=[KeyOut.of(k) for k in await store_call(store_of(services).list_keys, team_id)])


@router.delete(
    "/keys/{key_id}",
    summary="Revoke a key (takes effect within ~1 s on every replica)",
    responses={404: error_doc("No such key.")},
)
async def revoke_key(key_id: KeyId, services: ServicesDep) -> KeyOut:
    key = await store_call(store_of(services).revoke_key, key_id)
    invalidate_auth_cache(services)
    return KeyOut.of(key)


@router.patch(
    "/keys/{key_id}",
    summary="Change a team key's permissions (may_pick_variant; takes effect within ~1 s on every replica)",
    responses={404: error_doc("No such key.")},
)
async def update_key(key_id: KeyId, body: KeyUpdate, services: ServicesDep) -> KeyOut:
    if (await _key_or_404(services, key_id)).team_id is None:
        raise _admin_key_variants()
    key = await store_call(store_of(services).update_key, key_id, may_pick_variant=body.may_pick_variant)
    invalidate_auth_cache(services)
    return KeyOut.of(key)


def _admin_key_variants() -> APIError:
    return APIError(
        400,
        "Invalid 'may_pick_variant': admin keys belong to no team and make no inference calls; set it on a team key.",
        "invalid_value",
        param="may_pick_variant",
    )


def _admin_key_limits() -> APIError:
    return APIError(
        400,
        "Invalid 'limits': admin keys belong to no team and have no limits; create a team key for that.",
        "invalid_value",
        param="limits",
    )


async def _key_or_404(services: Services, key_id: str):
    key = await store_call(store_of(services).get_key, key_id)
    if key is None:
        raise APIError(404, f"No such key: {key_id!r}.", "key_not_found", param="key_id")
    return key


@router.get("/keys/{key_id}/limits", summary="Get a key's own limits", responses={404: error_doc("No such key.")})
async def get_key_limits(key_id: KeyId, services: ServicesDep) -> KeyLimitsBody:
    return KeyLimitsBody.of((await _key_or_404(services, key_id)).limits)


@router.put(
    "/keys/{key_id}/limits",
    summary="Replace a key's own limits (omitted fields: none of its own; its team's still apply)",
    responses={404: error_doc("No such key.")},
)
async def set_key_limits(key_id: KeyId, body: KeyLimitsBody, services: ServicesDep) -> KeyLimitsBody:
    if (await _key_or_404(services, key_id)).team_id is None:
        raise _admin_key_limits()
    key = await store_call(store_of(services).set_key_limits, key_id, body.to_limits())
    invalidate_auth_cache(services)
    return KeyLimitsBody.of(key.limits)
