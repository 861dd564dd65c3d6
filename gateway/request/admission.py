"""Admission: the request path's steps, in order, for one request:

    new_context -> check_events -> choose_variant -> check_model -> count_prompt -> apply_caps -> reserve -> take_slot
    -> enter_queue -> dispatch

(choose_variant lives in gateway/request/variant_choice.py: which variant of an alias, and may the key pick it.)

(reserve takes the concurrency slot too, in the same state call: one round trip on a shared state; take_slot
refuses the request whose slot was full.)

Every step either passes or raises an APIError whose `code` is the event's `reason` (a step that knows better
decides the outcome itself first: gateway/request/outcome.py). The RequestContext is made by
gateway/request/context.py, prompts are counted by gateway/openai/token_count.py; what comes after admission lives in
gateway/request/dispatch.py (hops, failover, relay). Admission makes the request's one end
(gateway/request/request_end.py: Settler.finish, exactly once: slots back, bill, event) and ends it as the handler
leaves, unless dispatch handed it to a stream's body. A client that leaves cancels the handler; whatever a
cancelled state call took is given back (Settler.take).

While the shared state is unreachable, reserving answers 503 `state_unavailable` (fail closed), or, with
`state.on_unavailable: fail_open`, admits under this replica's own in-process limits and writes their spend to
the shared state when it returns (through the outbox). While the event log cannot take a line (a full disk),
check_events refuses every request with 503 `events_unavailable` (gateway/accounting/event_faults.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tokenweir.common.http.disconnect import cancel_on_disconnect
from tokenweir.common.http.errors import APIError
from tokenweir.common.ids import random_hex
from tokenweir.common.logging import get_logger
from tokenweir.gateway.accounting.event_faults import unavailable
from tokenweir.gateway.accounting.events import EventWriter
from tokenweir.gateway.auth.authenticator import Principal
from tokenweir.gateway.config import GatewayConfig
from tokenweir.gateway.openai.endpoints import InferenceKind
from tokenweir.gateway.openai.token_count import ChatShape, TokenCounters, UnsupportedContent
from tokenweir.gateway.request.background import BackgroundTasks
from tokenweir.gateway.request.context import RequestContext, request_scope
from tokenweir.gateway.request.dispatch import Dispatcher
from tokenweir.gateway.request.inflight import InflightJournal
from tokenweir.gateway.request.queue import DispatchQueue, queue_for
from tokenweir.gateway.request.request_end import RequestEnd
from tokenweir.gateway.request.settle import Settler
from tokenweir.gateway.request.tracing import GatewayTracing
from tokenweir.gateway.request.variant_choice import baseline_pool, choose_variant
from tokenweir.gateway.state.backend import Lease, StateBackend, StateUnavailable
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.upstream.pools import Upstreams
from tokenweir.policies.caps import CapResult, apply_caps
from tokenweir.policies.decisions import Rejected
from tokenweir.policies.pricing import max_cost_over
from tokenweir.policies.reservation import Reservation

log = get_logger()

# The fields that bound a choice's length, per endpoint, as upstreams read them: chat takes either (vLLM and our
# engine prefer max_completion_tokens, older servers read max_tokens only); completions reads max_tokens only.
_LENGTH_FIELDS = {"chat": ("max_tokens", "max_completion_tokens"), "completions": ("max_tokens",)}


@dataclass(eq=False)
class Admission:
    """A request's way in: checked, counted, capped, reserved, given a slot and a place in its pool's queue, then
    handed to dispatch; its one end made first, so that whatever happens it is settled once."""

    config: GatewayConfig
    upstreams: Upstreams
    state: StateBackend
    local: InMemoryState | None  # fail_open: while the shared state is away, admit under this replica's own counters
    queues: dict[str, DispatchQueue]
    counters: TokenCounters
    events: EventWriter  # while it cannot take a line, nothing is admitted
    journal: InflightJournal  # what a request took, for a restart after this process dies
    settler: Settler
    dispatcher: Dispatcher
    background: BackgroundTasks
    tracing: GatewayTracing | None  # None when off
    state_ready: bool = True  # False until start-up has seeded the shared state's budgets
    seen_teams: set[str] = field(default_factory=set)  # whose per-team gauges /metrics refreshes

    async def handle(
        self, request: Request, principal: Principal, body: dict[str, Any], kind: InferenceKind
    ) -> Response:
        ctx = self.new_context(request, principal, body, kind)
        if self.tracing is not None:  # from its arrival; its end (Settler.finish) ends its spans
            ctx.trace = self.tracing.start(request, ctx, request_scope(request).t0)
        ctx.routes = self.upstreams.routes
        end = RequestEnd(ctx, self.settler, self.background)  # the request's one end, whatever happens next
        request_scope(request).accounted = True  # so its event is the end's, not finish_unadmitted's
        # A client that leaves while we wait (queue, upstream) cancels this task: nothing keeps running for it.
        watch = cancel_on_disconnect(request.receive)  # until the handler leaves: a stream's body watches for itself
        try:
            self.check_events()
            choose_variant(ctx, request.headers, principal.key.may_pick_variant)
            self.check_model(ctx)
            self.count_prompt(ctx)
            self.apply_caps(ctx)
            await self.reserve(ctx)
            ctx.seal()  # what it was counted at and granted is what dispatch routes and settle bills
            self.take_slot(ctx)
            await self.enter_queue(ctx)
            return await self.dispatcher.dispatch(ctx, end)
        except APIError as e:
            # Shed before any upstream saw it: rejected; after: an error (unless the step decided it, a timeout)
            ctx.outcome.decide("rejected" if not ctx.route else "error", e.code, e.status)
            raise
        except asyncio.CancelledError:
            ctx.upstream_may_run_on()
            if not watch.client_left():
                ctx.outcome.decide("cancelled", "shutdown", 503)
                raise  # not the client leaving: the server is shutting down past its grace
            ctx.outcome.decide("cancelled", "client_disconnected", 499, disconnected=True)
            return Response(status_code=499)
        except Exception:
            ctx.outcome.decide("error", "internal_error", 500)
            ctx.upstream_may_run_on()
            raise
        finally:
            watch.stop()
            await end.handler_exited()

    def check_events(self) -> None:
        """While the event log cannot take a line (a full disk), nothing is admitted: an answer must not go out
        unbilled (gateway/accounting/event_faults.py). Refused before anything is taken."""
        events = self.events
        if events.faults.fault is not None:
            raise unavailable(events.retry_after_s)

    def new_context(
        self, request: Request, principal: Principal, body: dict[str, Any], kind: InferenceKind
    ) -> RequestContext:
        if principal.team is None:
            raise APIError(
                403, "This key belongs to no team (admin keys manage the gateway); use a team key.", "no_team"
            )
        self.seen_teams.add(principal.team.id)
        scope = request_scope(request)
        ctx = RequestContext.admitted(scope.request_id, principal, body, kind)
        ctx.batch_id, ctx.responses_body = scope.batch_id, scope.responses_body
        return ctx

    def check_model(self, ctx: RequestContext) -> None:
        if ctx.model not in ctx.pools:
            raise APIError(
                404,
                f"The model '{ctx.model}' does not exist or you do not have access to it.",
                "model_not_found",
                param="model",
            )
        asked = ctx.alias or ctx.model  # a team is given the public name; an alias's variants come with it
        if not ctx.limits.allows_model(asked):
            raise APIError(403, f"Your team may not use the model '{asked}'.", "model_not_allowed", param="model")
        if ctx.key_limits is not None and not ctx.key_limits.allows_model(asked):
            raise APIError(403, f"This API key may not use the model '{asked}'.", "model_not_allowed", param="model")
        if ctx.kind == "embeddings" and not ctx.pools[ctx.model].serves_embeddings:
            raise APIError(
                400,
                f"The model '{ctx.model}' does not serve embeddings; use /v1/embeddings with an embedding model.",
                "model_not_supported",
                param="model",
            )

    def count_prompt(self, ctx: RequestContext) -> None:
        counter = self.counters(ctx.model)
        if ctx.kind == "embeddings":  # an input has a completion prompt's shapes, and is counted the same
            counts = counter.count_prompts(ctx.body["input"])
            ctx.prompt_tokens, ctx.longest_prompt = sum(counts), max(counts)
            return
        if ctx.kind == "completions":
            counts, ids = counter.completion_prompts(ctx.body["prompt"])
            ctx.prompt_tokens, ctx.longest_prompt, ctx.prompts = sum(counts), max(counts), len(counts)
            if ids is not None:  # an exact count of one string: the engine's ids, kept for prefix routing
                assert counter.tokenizer_path is not None
                ctx.prompt_ids = (counter.tokenizer_path, ids)
            return
        pool = ctx.pools[ctx.model].cfg
        # Our engines read text only; an external pool bills non-text parts its own way: reserve an upper bound.
        part_tokens = None if all(u.engine for u in pool.upstreams) else pool.non_text_part_tokens
        tool_format = None if pool.tool_call_parser == "none" else pool.tool_call_parser
        try:
            ctx.prompt_tokens, ids = counter.chat_prompt(
                ctx.body["messages"], part_tokens, ChatShape.of(ctx.body, tool_format)
            )
            ctx.longest_prompt = ctx.prompt_tokens
            if ids is not None:  # rendered as the engine renders it
                assert counter.tokenizer_path is not None  # ids come only from an exact count
                ctx.prompt_ids = (counter.tokenizer_path, ids)
        except UnsupportedContent as e:
            raise APIError(
                400,
                f"The model '{ctx.model}' takes text only: content part type '{e.part_type}' is not supported.",
                "unsupported_content",
                param=e.param,
            ) from None

    def apply_caps(self, ctx: RequestContext) -> None:
        body = ctx.body
        if ctx.kind == "embeddings":  # input only: the team's prompt cap applies, nothing is generated
            cap = apply_caps(ctx.prompt_tokens, None, max_prompt_tokens=ctx.limits.max_prompt_tokens)
            if cap.error is not None:
                ctx.outcome.decide("rejected", cap.error.reason, 400)
                raise APIError(400, cap.error.message.replace("messages", "input"), "context_length_exceeded", "input")
            ctx.max_tokens = 0
            return
        # The bounds the upstream honours on this endpoint (the schemas typed them; /v1/completions refused
        # max_completion_tokens): the tightest one bounds the reservation.
        bounds = [k for k in _LENGTH_FIELDS[ctx.wire] if body.get(k) is not None]
        requested = min((body[k] for k in bounds), default=None)
        pool = ctx.pools[ctx.model]

        def caps(context_window: int | None) -> CapResult:
            return apply_caps(
                ctx.prompt_tokens,
                requested,
                max_prompt_tokens=ctx.limits.max_prompt_tokens,
                max_output_tokens=ctx.limits.max_output_tokens,
                context_window=context_window,
                longest_prompt_tokens=ctx.longest_prompt,
            )

        cap = caps(pool.max_model_len)
        if cap.error is not None and cap.error.what == "context":  # a pool with a longer context may take it
            for longer in pool.cfg.context_window_fallbacks:
                fits = caps(ctx.pools[longer].max_model_len)
                if fits.error is None:
                    cap, ctx.context_fallback = fits, longer
                    break
        if cap.error is not None:
            # "too_long" in the event; OpenAI's code for the client
            ctx.outcome.decide("rejected", cap.error.reason, 400)
            raise APIError(400, cap.error.message, "context_length_exceeded", param=cap.error.param)
        max_tokens = cap.max_tokens
        if requested is None and ctx.limits.max_output_tokens is None:
            # Nothing but the context bounds it: reserve the gateway default, not the whole context window.
            max_tokens = min(max_tokens or self.config.default_max_tokens, self.config.default_max_tokens)
        per_choice = max_tokens or self.config.default_max_tokens
        # The upstream must never make more than we reserved for: every bound it was sent says max_tokens per
        # choice (whichever field it reads), and every choice it generates is reserved: n per prompt, or best_of
        # (generated and billed, though n are returned), for each prompt of a batch. Echo adds no output: the
        # echoed prompt is billed as prompt tokens (OpenAI, vLLM).
        for key in bounds or ("max_tokens",):
            body[key] = per_choice
        ctx.choices = ctx.prompts * max(body.get("n") or 1, body.get("best_of") or 1)
        ctx.max_tokens = per_choice * ctx.choices

    async def reserve(self, ctx: RequestContext) -> None:
        # Any hop of the route plan may serve it (the pool's own instances, then its fallbacks'), and the bill is at
        # the serving pool's prices: hold the dearest, or a cheap primary that is down lets a budget be overrun.
        pools = ctx.pools
        assert ctx.max_tokens is not None  # apply_caps set it
        target = ctx.context_fallback or ctx.model
        plan = [target, *pools[target].cfg.fallbacks]
        if (baseline := baseline_pool(ctx)) is not None:  # a rollout's canary: its baseline's pool is its last hop
            plan.append(baseline)
        if ctx.kind == "embeddings":  # as dispatch routes them: a fallback that serves no embeddings is no hop
            plan = [m for m in plan if m == ctx.model or pools[m].serves_embeddings]
        ctx.cost_reserved = max_cost_over((pools[m].cfg.prices for m in plan), ctx.prompt_tokens, ctx.max_tokens)
        # The key is a second subject of the same atomic reserve (the tighter wins); a key without limits is counted
        # too, so a limit set later applies to what it spent.
        key: dict[str, Any] = {"key_id": ctx.key_id, "key_limits": ctx.key_limits, "cost": ctx.cost_reserved}
        # The concurrency slot is taken in the same call, if the reservation is (a full slot leaves it taken: the
        # request is then refused, and its end gives it back).
        key["lease"] = lease = self.lease_for(ctx)
        try:
            try:
                if not self.state_ready:
                    raise StateUnavailable("the shared state is not seeded yet")
                # Named and journaled before it is taken: a restart after this process dies, even mid-call, frees it.
                self.journal.slot(ctx, lease_id=lease.lease_id, key_id=lease.key_id)
                admit = self.state.reserve_and_acquire(
                    ctx.team_id, ctx.limits, ctx.prompt_tokens, ctx.max_tokens, **key
                )
                taken = await self.settler.take(admit, lambda admitted: self.give_back(admitted, lease), ctx)
                ctx.reservation, got = taken
            except StateUnavailable as e:
                self.settler.defer(e)
                if self.local is None:
                    raise self.state_unavailable(e) from None
                log.warning("state_unavailable_fail_open", error=str(e))
                ctx.local_state = True
                local = self.local.reserve_and_acquire(
                    ctx.team_id, ctx.limits, ctx.prompt_tokens, ctx.max_tokens, **key
                )
                ctx.reservation, got = await local
        except Rejected as r:
            raise _api_error(r) from None
        self.journal.reserved(ctx)  # a restart after this process dies settles it (gateway/request/inflight.py)
        if got:
            ctx.slot, ctx.slot_key_id, ctx.slot_lease = True, lease.key_id, lease.lease_id

    @staticmethod
    def lease_for(ctx: RequestContext) -> Lease:
        """The request's concurrency lease: the team's slot, and the key's own where the key has a cap."""
        key_max = ctx.key_limits.max_concurrency if ctx.key_limits is not None else None
        key_id = ctx.key_id if key_max is not None else None  # a key without a cap of its own takes no key slot
        return Lease(random_hex(), key_id, ctx.limits.max_concurrency, key_max)

    def give_back(self, taken: tuple[Reservation, bool], lease: Lease) -> Awaitable[Reservation]:
        """Undo a reserve_and_acquire whose caller left: the hold settled at nothing, the lease back if it was taken."""
        reservation, got = taken
        return self.state.settle_and_release(reservation, 0, 0, lease=lease if got else None)

    def state_unavailable(self, err: Exception) -> APIError:
        log.warning("state_unavailable", error=str(err))
        retry = self.config.state.retry_after_s
        return APIError(
            503,
            f"The gateway cannot reach its shared limits state; retry in {retry}s.",
            "state_unavailable",
            headers={"retry-after": str(retry)},
        )

    def take_slot(self, ctx: RequestContext) -> None:
        """Refuse the request whose concurrency slot was full when its reservation was taken."""
        key_max = ctx.key_limits.max_concurrency if ctx.key_limits is not None else None
        if not ctx.slot:
            team_max = ctx.limits.max_concurrency
            whose = "this API key" if key_max is not None and (team_max is None or key_max <= team_max) else "your team"
            most = key_max if whose == "this API key" else team_max
            raise APIError(
                429,
                f"Too many requests in flight: {whose} may run {most} at once. Retry when one finishes.",
                "concurrency",
                headers={"retry-after": "1"},
            )

    async def enter_queue(self, ctx: RequestContext) -> None:
        timeout = ctx.limits.queue_timeout_s or self.config.timeouts.queue_s
        if ctx.trace is not None:
            ctx.trace.phase("queue")
        try:
            queue = queue_for(self.queues, ctx.pools[ctx.model].cfg)
            ctx.ticket = await queue.acquire(ctx.team_id, ctx.priority, ctx.limits.weight, timeout, ctx.prompt_tokens)
        except Rejected as r:
            raise _api_error(r) from None
        ctx.queue_s = ctx.ticket.queue_s
        if ctx.trace is not None:
            ctx.trace.end_phase()


def _api_error(r: Rejected) -> APIError:
    return APIError(r.status, r.message, r.reason, headers=r.headers)
