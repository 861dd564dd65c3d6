"""Which variant of an alias a request gets, admission's first step: one of the alias's variants by weight, sticky
per the alias's subject (policies/variants.py), or the one the `x-tokenweir-variant` header names.

Picking by header is a permission of the API key, granted by the admin (`may_pick_variant`): with it, any variant,
one of weight 0 included (that is how an operator tests a dark variant); without it, the header is refused (403
`variant_not_allowed`) before anything else is known of the request. A request routed by the header is `steered`:
served, billed and recorded as that variant, but left out of its rollout's windows (gateway/request/settle.py), so
that no tenant can steer a rollout's verdict by choosing where its requests go.

A rollout's canary request (not steered) has its baseline's pool as its last hops (`baseline_hops`): a canary that
fails, or has no member left to try, never costs its client the answer, and the request still counts as the canary's
failure (another pool served it).
"""

from __future__ import annotations

from starlette.datastructures import Headers

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.accounting.request_event import clip
from tokenweir.gateway.request.context import RequestContext
from tokenweir.gateway.upstream.pools import Hop, Upstreams
from tokenweir.policies import variants

VARIANT_HEADER = "x-tokenweir-variant"  # picks an alias's variant outright (testing one), for a key that may


def choose_variant(ctx: RequestContext, headers: Headers, may_pick: bool) -> None:
    """From here on `ctx.model` is the chosen variant's pool (`ctx.alias`, `ctx.variant`: which one, `ctx.steered`:
    chosen by the header). A model that is no alias is left as it is, header or not."""
    alias = ctx.aliases.get(ctx.model)
    if alias is None:
        return
    asked = headers.get(VARIANT_HEADER)
    if asked is not None and not may_pick:
        raise APIError(
            403,
            f"This API key may not pick a variant of '{alias.model}' with the {VARIANT_HEADER} header: send the "
            "request without it, or ask your gateway admin to allow this key to pick variants (may_pick_variant).",
            "variant_not_allowed",
            param=VARIANT_HEADER,
        )
    names = [v.name for v in alias.variants]
    if asked is not None and asked not in names:
        raise APIError(
            400, f"{VARIANT_HEADER}: '{clip(asked)}' is not a variant of '{alias.model}' ({', '.join(names)}).",
            "invalid_variant", param=VARIANT_HEADER,
        )  # fmt: skip
    if asked is not None:
        variant = alias.variants[names.index(asked)]
    else:
        subject = ctx.key_id or ""
        if alias.sticky == "user":
            subject = ctx.user or subject
        elif alias.sticky.startswith("header:"):
            subject = headers.get(alias.sticky[7:]) or subject
        point = variants.subject_point(alias.model, subject)
        variant = alias.variants[variants.pick_variant([v.weight for v in alias.variants], point)]
    ctx.alias, ctx.variant, ctx.model = alias.model, variant.name, variant.pool
    ctx.steered = asked is not None


def baseline_pool(ctx: RequestContext) -> str | None:
    """The baseline's pool of a rollout whose canary this request got by weight; None for any other request (one
    steered to the canary by the header sees the canary's own failures)."""
    alias = ctx.aliases.get(ctx.alias) if ctx.alias is not None else None
    r = alias.rollout if alias is not None else None
    if alias is None or r is None or ctx.variant != r.canary or ctx.steered:
        return None
    pool = alias.variant(r.baseline).pool
    return pool if pool != ctx.model and pool in ctx.pools else None


def baseline_hops(ctx: RequestContext, upstreams: Upstreams, plan: list[Hop]) -> list[Hop]:
    """The hops to add after a canary request's route `plan`: its baseline pool's members, unless the plan has them."""
    pool = baseline_pool(ctx)
    if pool is None or any(h.model == pool for h in plan):
        return []
    hops, _, _ = upstreams.route(pool, None, ctx.model, ctx.routes)
    return [h for h in hops if h.model == pool]
