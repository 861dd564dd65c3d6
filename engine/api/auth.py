"""The engine's API key (`--api-key`, or TOKENWEIR_ENGINE_API_KEY as vLLM reads VLLM_API_KEY): every route but the
probes (`/health`, `/metrics`) needs `Authorization: Bearer <key>`, so a local process cannot be served around the
gateway's admission and billing, nor abort another tenant's request. `/load` is guarded too: the gateway polls it
with the key, and it tells a stranger how busy the engine is and which prefixes it caches.

Pure ASGI, outermost but for the request id (a refusal still carries X-Request-Id): nothing of the request is read
before the key is checked. The comparison is constant-time (hmac.compare_digest)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenweir.common.engine_flags import API_KEY_ENV
from tokenweir.common.http.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes: a load balancer and Prometheus hold no key


def missing_key_error() -> APIError:
    return APIError(
        401,
        "This engine needs an API key: pass 'Authorization: Bearer <key>' (the key its --api-key or "
        f"{API_KEY_ENV} was given).",
        "invalid_api_key",
    )


def wrong_key_error() -> APIError:
    return APIError(401, "Incorrect API key provided for this engine.", "invalid_api_key")


class ApiKeyMiddleware:
    """Refuses a request without the right bearer key with a 401 `invalid_api_key` (OpenAI's shape)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization")
        if given is None:
            err = missing_key_error()
        else:
            scheme, _, secret = given.partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(secret.strip(), self.key):
                return await self.app(scope, receive, send)
            err = wrong_key_error()
        await err.response()(scope, receive, send)
