"""Shadow traffic: a sampled fraction of a pool's chats and completions mirrored to its `shadow_pool`, to see how
another pool (a new model version, an engine build) serves real traffic. A mirror is bounded by what the tenant paid
for, so that a tenant cannot use it to make free work:

- it is decided at dispatch (`sample`) and sent only once the primary has ended and been billed: the request's end
  (gateway/request/request_end.py) hands it the output tokens billed, and the mirror asks at most those, per choice
  (max_tokens, and max_completion_tokens where the body has it); a primary that made nothing is not mirrored. A client
  that left mid-stream was billed what was made, and the mirror asks that much;
- it runs in the lowest band (priority 2, batch) whatever the client's priority;
- it is billed to no team: its requests, latency and tokens go to the tokenweir_gateway_shadow_* metrics only, and it
  starts after the primary's answer and settle, in the background, so it never delays or changes either;
- at most SHADOWS_IN_FLIGHT mirrors are out at once per shadow pool, per process (past it, dropped: counted, never
  queued), so a hung shadow pool cannot starve another's.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from tokenweir.common.ids import random_hex
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.config import GatewayConfig
from tokenweir.gateway.openai.endpoints import KIND_PATHS, InferenceKind
from tokenweir.gateway.request.background import BackgroundTasks
from tokenweir.gateway.request.cache_scope import request_salt, with_salt
from tokenweir.gateway.request.context import RequestContext
from tokenweir.gateway.state.member_slots import MemberSlots
from tokenweir.gateway.upstream import calls
from tokenweir.gateway.upstream.client import UpstreamClient
from tokenweir.gateway.upstream.pools import Hop, Pool
from tokenweir.policies.limits import PRIORITY_BATCH

SHADOWS_IN_FLIGHT = 64  # mirrors out at once per shadow pool, per process: past it a mirror is dropped
_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")  # what bounds a choice's length (chat reads either)
_STREAM_FIELDS = ("stream", "stream_options")  # a mirror is one JSON answer


@dataclass(slots=True, frozen=True)
class Mirror:
    """A request sampled for mirroring at dispatch; sent once it has ended (ShadowMirror.send)."""

    model: str  # the primary's pool
    shadow: Pool  # its shadow pool, in the routing table the request was admitted under
    kind: InferenceKind
    body: dict[str, Any]  # the client's body as admission bounded it, without its stream fields, with its cache salt
    choices: int  # sequences the upstream generates per request: prompts x max(n, best_of)
    total_s: float  # the mirror's time limit: the primary pool's (a mirror has no team)


def mirror_body(body: dict[str, Any], per_choice: int, engine: bool) -> dict[str, Any]:
    """The body a mirror sends: at most `per_choice` output tokens per choice, in the batch band. An external member
    is sent `priority` only if the client sent one (an OpenAI server may refuse a field it does not know)."""
    out = dict(body)
    bounds = [key for key in _LENGTH_FIELDS if out.get(key) is not None]
    for key in bounds or ("max_tokens",):
        out[key] = min(out.get(key) or per_choice, per_choice)
    if engine or "priority" in out:
        out["priority"] = PRIORITY_BATCH
    return out


class ShadowMirror:
    def __init__(
        self,
        config: GatewayConfig,
        client: UpstreamClient,
        metrics: Metrics,
        members: MemberSlots,
        background: BackgroundTasks,
    ) -> None:
        self.config, self.client, self.metrics, self.members, self.background = (
            config,
            client,
            metrics,
            members,
            background,
        )
        self.in_flight: dict[str, int] = {}  # shadow pool -> its mirrors out now, from this process

    def sample(self, ctx: RequestContext) -> Callable[[int], None] | None:
        """Whether the request is mirrored (its pool's shadow_fraction): what its end calls with the output tokens
        billed, or None."""
        pool = ctx.pools[ctx.model].cfg
        if pool.shadow_pool is None or ctx.kind == "embeddings" or random.random() >= pool.shadow_fraction:
            return None
        body = {k: v for k, v in ctx.body.items() if k not in _STREAM_FIELDS}
        body = with_salt(body, request_salt(ctx, ctx.model))  # no team pays for it: the primary's cache scope
        total_s = pool.total_timeout_s or self.config.timeouts.total_s
        return partial(self.send, Mirror(ctx.model, ctx.pools[pool.shadow_pool], ctx.wire, body, ctx.choices, total_s))

    def send(self, mirror: Mirror, completion_tokens: int) -> None:
        """The primary has ended, billed `completion_tokens` of output: mirror it in the background, asking at most
        that many over all its choices. Not when it made none, or less than one per choice (counted "skipped"), nor
        while SHADOWS_IN_FLIGHT mirrors to the same shadow pool are out ("dropped")."""
        shadow = mirror.shadow.model
        per_choice = completion_tokens // max(mirror.choices, 1)
        if per_choice < 1 or self.in_flight.get(shadow, 0) >= SHADOWS_IN_FLIGHT:
            self.metrics.shadow_requests.labels(mirror.model, shadow, "skipped" if per_choice < 1 else "dropped").inc()
            return
        self.in_flight[shadow] = self.in_flight.get(shadow, 0) + 1
        self.background.spawn(self.mirror(mirror, per_choice))

    async def mirror(self, mirror: Mirror, per_choice: int) -> None:
        """One mirrored request, non-stream, under the primary pool's total limit; what it made is counted in the
        shadow metrics only."""
        status, started = "error", time.perf_counter()
        model, shadow = mirror.model, mirror.shadow.model
        members = mirror.shadow.ranked(time.monotonic())
        hop = Hop(shadow, members[0], shadow) if members else None
        member, lease = "", None
        try:
            if hop is None:
                return  # every member's circuit is open
            cap = hop.instance.cfg.max_parallel_requests
            if cap is not None:  # a mirror never waits for a member, nor pushes one past its cap
                member = hop.instance.cfg.base_url
                lease = await self.members.take(member, cap)
                if lease is None:
                    status = "dropped"
                    return
            body = mirror_body(mirror.body, per_choice, hop.instance.cfg.engine)
            hop.instance.take(time.monotonic())
            deadline = asyncio.get_running_loop().time() + mirror.total_s
            ok, upstream_id = False, "tw-shadow-" + random_hex()
            try:
                answer, _ = await calls.call_json(
                    self.client, hop, KIND_PATHS[mirror.kind], body, upstream_id, deadline
                )
                ok, status = True, "ok"
            except TimeoutError:
                status = "timeout"
                if hop.instance.cfg.engine:  # it may still be generating: stopped, without holding the count here
                    self.background.spawn(calls.abort(self.client, hop, upstream_id))
            except (calls.UpstreamFailed, calls.UpstreamRejected):
                pass
            finally:
                hop.instance.done(ok, time.monotonic())
            self.metrics.shadow_e2e.labels(model, shadow).observe(time.perf_counter() - started)
            usage = answer.get("usage") if ok else None
            if isinstance(usage, dict):
                for key in ("prompt_tokens", "completion_tokens"):
                    tokens = usage.get(key)
                    if type(tokens) is int and tokens > 0:
                        self.metrics.shadow_tokens.labels(model, shadow, key.removesuffix("_tokens")).inc(tokens)
        finally:
            if lease is not None:
                await self.members.give_back(member, lease)
            self.in_flight[shadow] -= 1
            if not self.in_flight[shadow]:
                del self.in_flight[shadow]
            self.metrics.shadow_requests.labels(model, shadow, status).inc()
