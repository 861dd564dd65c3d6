"""Who calls: the FastAPI dependencies that authenticate a request (any key; an admin key) and note the caller in
the request's scope, for the event of a request refused after auth but before admission. The lookup itself is
gateway/auth/authenticator.py."""

from __future__ import annotations

from fastapi import Depends, Request

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.auth.authenticator import Principal, invalid_key
from tokenweir.gateway.deps.services import ServicesDep
from tokenweir.gateway.request.context import request_scope


def bearer_secret(request: Request) -> str | None:
    """The key from 'Authorization: Bearer <key>' (OpenAI SDKs) or 'x-api-key' (some other clients)."""
    header = request.headers.get("authorization")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise invalid_key("Malformed Authorization header: expected 'Authorization: Bearer tw-...'.")
        return value.strip()
    return request.headers.get("x-api-key")


async def require_key(request: Request, services: ServicesDep) -> Principal:
    """FastAPI dependency: any valid key. Also noted in the request's scope, for the event of a request refused
    after auth but before admission."""
    principal = await services.authenticator.authenticate(bearer_secret(request))
    request_scope(request).principal = principal
    return principal


async def require_admin(principal: Principal = Depends(require_key)) -> Principal:
    if not principal.key.is_admin:
        raise APIError(403, "This endpoint needs an admin API key.", "admin_required")
    return principal
