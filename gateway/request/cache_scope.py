"""A request's prefix-cache scope: the `cache_salt` (vLLM's request field; common/text/prefix_hash.py) the gateway
sends with every chat and completion to an upstream, our engines and vLLM members alike, and hashes the prompt's
blocks with for prefix routing, so that the router and the engine name the same cache keys.

Why: an engine's prefix cache is a side channel between tenants. How much of a prompt a request finds cached
(`usage.prompt_tokens_details.cached_tokens`, and its time to first token) tells whether someone sent that prefix
before, so one team could test guesses of another's confidential system prompt (vLLM's CVE-2025-46570). A salt per
team keeps each team's cache its own. The pool's `cache_scope` says whose: "team", "key" (one API key's) or "shared"
(no salt: every team's hits show to every other). A client's own `cache_salt` narrows its scope (it is mixed into the
gateway's, never replaces it): whatever a client sends, its request never carries a salt another team's do. A member
that refuses fields it does not know (OpenAI's own API) is in a pool with `cache_scope: shared` (no salt sent).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from tokenweir.gateway.request.context import RequestContext

_VERSION = "tokenweir-cache-salt-v1"


def cache_salt(scope: str, team_id: str, key_id: str, client_salt: str | None = None) -> str | None:
    """The salt of a request of `team_id`'s key `key_id` under `scope`, with the client's own `client_salt`; None (no
    salt: the shared cache) for a shared scope without one. One sha256 over every part, each in its own place, so
    neither a client's salt nor an id can stand in for another scope's or owner's."""
    if scope == "shared" and client_salt is None:
        return None
    owner = {"team": team_id, "key": key_id, "shared": ""}[scope]
    return hashlib.sha256(orjson.dumps([_VERSION, scope, owner, client_salt])).hexdigest()


def request_salt(ctx: RequestContext, model: str) -> str | None:
    """The salt of the request `ctx` sent to pool `model` (its requested pool's for a mirror, which no team pays).
    None for embeddings: they report no cached tokens, and their usual upstreams (OpenAI's own) refuse the field."""
    if ctx.kind == "embeddings":
        return None
    client = ctx.body.get("cache_salt")
    scope = ctx.pools[model].cfg.cache_scope
    return cache_salt(scope, ctx.team_id, ctx.key_id, client if isinstance(client, str) and client else None)


def with_salt(body: dict[str, Any], salt: str | None) -> dict[str, Any]:
    """A copy of `body` sent with `salt` (a client's own cache_salt is left out: `salt` holds it already)."""
    out = {k: v for k, v in body.items() if k != "cache_salt"}
    if salt is not None:
        out["cache_salt"] = salt
    return out
