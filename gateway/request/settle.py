"""The end of every request: stop the upstream if it may still run, give back every slot and the unused
reservation, bill what was made, and write the one JSONL event (gateway/accounting/events.py) with its metrics. `take`
is the giving back's other half: what a state call takes for a request the client then leaves is given back too.

A request has one of two ends. `finish` ends an admitted one, exactly once, called only by its RequestEnd
(gateway/request/request_end.py: shielded from cancellation; for a stream when its body is over).
`finish_unadmitted` ends one refused before admission: its event only, nothing was taken. Each step of `finish`
has its own guard, so one that raises never skips the ones after it; a settle or a slot release the shared state
cannot take now goes to the outbox (gateway/state/outbox.py) and is replayed when it can. The event is written before
the usage row is counted: it is the write-ahead record that start-up replays after a crash. `finish` awaits the
event's group commit (EventWriter.commit), so its line is in the file before the answer of a non-stream request is
sent (the handler's end settles it before returning the answer); `finish_unadmitted` cannot await (it is called from
sync error paths) and writes its line at once (EventWriter.emit).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from tokenweir.common.http.errors import APIError
from tokenweir.common.ids import random_hex
from tokenweir.common.logging import get_logger
from tokenweir.gateway.accounting.events import EventWriter
from tokenweir.gateway.accounting.metrics import OUTPUT_BUCKETS, PROMPT_BUCKETS, Metrics, length_bucket
from tokenweir.gateway.accounting.request_event import Billed, clip, request_event
from tokenweir.gateway.accounting.usage import UsageRecorder
from tokenweir.gateway.openai.endpoints import InferenceKind
from tokenweir.gateway.openai.token_count import TokenCounter
from tokenweir.gateway.request import billing, relay
from tokenweir.gateway.request.background import BackgroundTasks, Done
from tokenweir.gateway.request.billing import Bill
from tokenweir.gateway.request.context import RequestContext, RequestRecord, RequestScope
from tokenweir.gateway.request.inflight import InflightJournal
from tokenweir.gateway.request.outcome import Outcome
from tokenweir.gateway.request.queue import DispatchQueue
from tokenweir.gateway.request.stream_chunks import ChunkFilter
from tokenweir.gateway.runtime.rollouts import Rollouts
from tokenweir.gateway.state.backend import Lease, StateBackend, StateUnavailable
from tokenweir.gateway.state.member_slots import MemberSlots
from tokenweir.gateway.state.outbox import StateOutbox
from tokenweir.gateway.upstream.pools import Hop, Upstreams
from tokenweir.policies.budget import day_key
from tokenweir.policies.canary import judged
from tokenweir.policies.pricing import femtos_to_usd

log = get_logger()

T = TypeVar("T")


@dataclass(eq=False)
class Settler:
    """The end of every request: what it took given back, what it made billed, its one event."""

    upstreams: Upstreams
    state: StateBackend
    local: StateBackend | None  # this replica's own limits, while the shared state is away (fail_open)
    queues: dict[str, DispatchQueue]
    events: EventWriter
    metrics: Metrics
    usage: UsageRecorder
    outbox: StateOutbox | None
    counter: Callable[[str], TokenCounter]
    background: BackgroundTasks
    members: MemberSlots  # pool members' max_parallel_requests, across replicas: the attempts' slots go back here
    # What each running request took and where it went, for a restart after this process dies
    journal: InflightJournal
    rollouts: Rollouts | None = None  # judges aliases' canaries by their requests' outcomes

    def dispatched(self, ctx: RequestContext, hop: Hop) -> None:
        """Dispatch is about to send an attempt to `hop` under `ctx.upstream_id`: journaled, so that a restart
        after this process dies can ask that instance what it made."""
        self.journal.hop(ctx, hop)

    def finish_unadmitted(self, scope: RequestScope, kind: InferenceKind, err: APIError) -> None:
        """The end of a request refused before admission (bad key, malformed body, an admin key, a client gone while
        its body was read): nothing was taken, so only its one event. Its team, key and model may be unknown."""
        self.events.emit(self.event(unadmitted_record(scope, kind, err), time.perf_counter(), 0, 0, 0))

    def release_hop(self, ctx: RequestContext, ok: bool) -> None:
        """The request's live attempt is done with (once): its instance hears `ok`, its member slot goes back."""
        attempt = ctx.live_attempt
        if attempt is None:
            return
        lease = attempt.release(ok)
        if lease is not None:
            self.background.start(self.members.give_back(*lease))
        self.metrics.in_flight.labels(ctx.model).dec()
        ctx.upstream_error = attempt.hop.error or ctx.upstream_error
        if ctx.trace is not None:  # the request's own outcome where it ended on this hop
            ctx.trace.end_hop(ctx.outcome.status if ctx.outcome.decided else "ok" if ok else "failed")

    async def finish(self, ctx: RequestContext, stream: relay.HopStream | None) -> int:
        """The end of an admitted request (its RequestEnd's one call): `stream` is its last hop's upstream stream,
        if one is open or was relayed (what its chunks said is billed). Returns the output tokens billed."""
        attempt = ctx.live_attempt
        try:
            # 1) Stop an upstream that may still be generating; our engine answers with the exact usage made.
            if attempt is not None and attempt.incomplete and attempt.engine:
                answer = await attempt.abort()
                if answer and answer.get("usage"):
                    ctx.usage, ctx.usage_source = answer["usage"], "engine_abort"
                    ctx.kv_transfer = answer.get("kv_transfer_params") or ctx.kv_transfer
                elif answer and answer.get("status") == "unknown" and ctx.ttft_s is None:
                    # cut before it reached the engine, which now refuses it should it arrive: nothing was made.
                    # (After a first token the engine did have it and has restarted since: billed as before.)
                    ctx.usage, ctx.usage_source = {"prompt_tokens": 0, "completion_tokens": 0}, "engine_abort"
            if stream is not None:  # a stream read to its end is drained: its keep-alive connection goes back
                await stream.close(drain=stream.chunks.done and not (attempt is not None and attempt.incomplete))
        except Exception:  # noqa: BLE001 - whatever broke here, the bill and the slots below must still happen
            log.exception("finish_upstream_cleanup_failed", request_id=ctx.request_id)
        # 2) Slots back, then settle and account: each step guarded, so none is skipped because another raised.
        state = self.local if ctx.local_state else self.state
        lease = None  # its own lease, the one it journaled: given back with the settle below, in one state call
        if ctx.slot:
            ctx.slot = False
            assert ctx.reservation is not None  # a slot is only ever taken with its reservation (Admission.reserve)
            lease = Lease(ctx.slot_lease or "", ctx.slot_key_id)
        chunks = stream.chunks if stream is not None else None
        try:
            prompt, completion, cached = self.billable(ctx, chunks)
        except Exception:  # noqa: BLE001 - never drop a bill: fall back to what was counted at admission
            log.exception("finish_billable_failed", request_id=ctx.request_id)
            prompt, completion, cached = ctx.prompt_tokens if ctx.route else 0, 0, 0
        if ctx.ticket is not None:  # its output is its team's service, in a queue fair by tokens
            self._guard(self.queues[ctx.model].release, ctx.ticket, completion)
        if attempt is not None:
            self._guard(self.release_hop, ctx, attempt.instance_ok)
        cost = None
        try:
            cost = self.cost(ctx, prompt, completion, cached)
        except Exception:  # noqa: BLE001 - a price that cannot be applied must not skip the settle below
            log.exception("finish_cost_failed", request_id=ctx.request_id)
        ts = time.time()
        if ctx.reservation is not None:
            assert state is not None  # as above
            settle = state.settle_and_release(ctx.reservation, prompt, completion, ts, cost=cost or 0, lease=lease)
            await self.state_change(settle, ctx)
            if ctx.local_state and self.outbox is not None:
                # Admitted while the shared state was away: its spend reaches the shared budgets when it returns.
                op = {"op": "settle", "team_id": ctx.team_id, "res_id": "local-" + random_hex()}
                key_id = ctx.reservation.key_id
                self.outbox.put(op | {"tokens": prompt + completion, "now": ts, "key_id": key_id, "cost": cost or 0})
        try:
            await self.record(ctx, ts, prompt, completion, cached, cost, chunks)
        except Exception:  # noqa: BLE001 - the journal's line below must still be written
            log.exception("finish_step_failed", step="record")
        self._guard(self.journal.done, ctx)  # written by record, right after the event: here only if record raised
        if ctx.trace is not None:
            self._guard(ctx.trace.finish, ctx.outcome, prompt, completion)
        return completion

    def cost(self, ctx: RequestRecord, prompt: int, completion: int, cached: int) -> int | None:
        """What the request cost, exactly, in femto-USD at the prices of the pool that served it (None: unpriced):
        never rounded per request, so the state's spend, the usage rows and the events all sum exactly."""
        model = ctx.served_model or ctx.model
        routes = getattr(ctx, "routes", None) or self.upstreams.routes  # a journal's record has no table: today's
        pool = routes.pools.get(model) if model is not None else None
        prices = pool.cfg.prices if pool is not None else None
        return None if prices is None else prices.cost_femtos(prompt, completion, cached)

    async def record(
        self,
        ctx: RequestRecord,
        ts: float,
        prompt: int,
        completion: int,
        cached: int,
        cost: int | None = None,
        chunks: ChunkFilter | None = None,
    ) -> None:
        """The request's one event, its journal's "done" and, if an upstream was tried, its usage row: the event
        first, the write-ahead record that start-up replays when a crash kept the usage row out of the store; the
        store directly where the event log cannot take it (gateway/request/billing.py)."""
        event = self.event(ctx, time.perf_counter(), prompt, completion, cached, ts, cost, chunks)
        bill = None
        if ctx.route:
            assert ctx.team_id is not None  # a request sent upstream was admitted, for a team
            model = ctx.served_model or ctx.model
            assert model is not None
            bill = Bill(ctx.team_id, model, prompt, completion, cached, day_key(ts), ctx.key_id, ctx.user, cost or 0)
        await billing.record(
            ctx, event, bill, events=self.events, journal=self.journal, usage=self.usage, metrics=self.metrics
        )

    def defer(self, err: StateUnavailable) -> None:
        """Keep the change a failed state call still owes (a settle, a release, an undo) for the outbox."""
        if err.pending is not None and self.outbox is not None:
            self.outbox.put(err.pending)

    async def state_change(self, change: Awaitable[object], ctx: RequestContext) -> None:
        try:
            await change
        except StateUnavailable as e:
            self.defer(e)
            log.warning("state_change_deferred", request_id=ctx.request_id, error=str(e))
        except Exception:  # noqa: BLE001
            log.exception("state_change_failed", request_id=ctx.request_id)

    async def take(
        self, call: Coroutine[Any, Any, T], give_back: Callable[[T], Awaitable[object]], ctx: RequestContext
    ) -> T:
        """Await a state call that takes something (a hold, a slot). If the client leaves meanwhile, the call still
        completes, and what it took is given back: a cancelled round trip must not leave a hold or a lease
        behind until its expiry. (A call that completes without suspending, in-memory state's, cannot be left.)"""
        task = self.background.start(call)
        if isinstance(task, Done):
            return cast(T, task.value)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:

            def undo(t: asyncio.Task[T]) -> None:
                if t.cancelled():
                    return
                if isinstance(exc := t.exception(), StateUnavailable):
                    self.defer(exc)
                elif t.exception() is None and t.result():
                    self.background.spawn(self.state_change(give_back(t.result()), ctx))

            task.add_done_callback(undo)
            raise

    @staticmethod
    def _guard(step: Callable[..., object], *args: object) -> None:
        try:
            step(*args)
        except Exception:  # noqa: BLE001 - one failed step must not skip the others
            log.exception("finish_step_failed", step=getattr(step, "__name__", str(step)))

    def billable(self, ctx: RequestContext, chunks: ChunkFilter | None) -> tuple[int, int, int]:
        """What the request cost: the upstream's own usage when it reported one, else our count; plus what
        hops that failed before the first token had already made."""
        prompt, completion, cached = self._billable(ctx, chunks)
        return prompt + ctx.spilled_prompt_tokens, completion + ctx.spilled_completion_tokens, cached

    def _billable(self, ctx: RequestContext, chunks: ChunkFilter | None) -> tuple[int, int, int]:
        """The last hop's usage, and how it was obtained (`ctx.usage_source`, the event's `usage_source`)."""
        usage = ctx.usage or (chunks.usage if chunks is not None else None)
        if usage:
            ctx.usage_source = ctx.usage_source or "upstream"
            details = usage.get("prompt_tokens_details") or {}
            cached = usage.get("cached_tokens") or (details.get("cached_tokens") if isinstance(details, dict) else 0)
            if (drafts := usage.get("completion_tokens_details")) and isinstance(drafts, dict):
                ctx.note_drafts(drafts)
            return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0), int(cached or 0)
        if ctx.live_attempt is None:  # no hop served it: only what failed hops' engines made
            ctx.usage_source = "engine_abort" if ctx.spilled_prompt_tokens or ctx.spilled_completion_tokens else None
            return 0, 0, 0
        completion = 0
        if chunks is not None and chunks.text:
            completion = self.counter(ctx.model).count_text("".join(chunks.text))
        if chunks is not None and chunks.done:
            # The whole answer was relayed, only its usage was not sent: its text is what was made.
            ctx.usage_source = "estimate_text"
            return ctx.prompt_tokens, completion, 0
        # Cut before its usage arrived (client gone, upstream broken, timeout) and no engine to ask: what was relayed
        # is only a lower bound (an upstream runs ahead of the relay, and a provider may generate, and bill, past a
        # dropped connection). The reservation bounds what it could make (it was sent max_tokens per choice).
        ctx.usage_source = "reservation_bound"
        return ctx.prompt_tokens, max(completion, ctx.max_tokens or 0), 0

    def event(
        self,
        ctx: RequestRecord,
        now: float,
        prompt: int,
        completion: int,
        cached: int,
        ts: float | None = None,
        cost: int | None = None,
        chunks: ChunkFilter | None = None,
    ) -> dict[str, Any]:
        """The request's event (gateway/accounting/request_event.py), for the caller to write (EventWriter.commit or
        .emit); its metrics are observed and an overrun logged here."""
        e2e = now - ctx.t0
        tpot = None
        per_choice = completion / max(ctx.choices, 1)  # n choices stream side by side: time per token of one
        if chunks is not None and chunks.first_token_at is not None and per_choice > 1:
            assert chunks.last_token_at is not None  # set with first_token_at
            tpot = (chunks.last_token_at - chunks.first_token_at) / (per_choice - 1)
        if ctx.finish_reason is None and chunks is not None:
            ctx.finish_reason = chunks.finish_reason
        billed = Billed(prompt, completion, cached, cost)
        transfer = ctx.kv_transfer or (chunks.kv_transfer if chunks is not None else None)
        event = request_event(ctx, billed, ts or time.time(), e2e, tpot, transfer)
        if event["overrun_tokens"]:
            log.warning(
                "upstream_overran_reservation",
                request_id=ctx.request_id,
                instance=ctx.route[-1],
                reserved=ctx.max_tokens,
                completion_tokens=completion,
            )
        self.observe(ctx, billed, now, tpot)
        return event

    def observe(self, ctx: RequestRecord, billed: Billed, now: float, tpot: float | None) -> None:
        """The request's metrics, and a log line for one that did not end ok."""
        m, e2e, outcome = self.metrics, now - ctx.t0, ctx.outcome
        # Label values come from clients (a made-up model name, no team at all): keep their number bounded.
        model = ctx.model if ctx.model in self.upstreams.pools else "unknown"
        m.requests.labels(ctx.team_id or "none", model, outcome.status).inc()
        if ctx.alias is not None:
            m.variant_requests.labels(ctx.alias, ctx.variant, outcome.status).inc()
            self.observe_variant(ctx, tpot)
        if outcome.status == "rejected":
            m.rejections.labels(outcome.reason or "unknown").inc()
        if billed.prompt or billed.completion:
            m.prompt_tokens.labels(ctx.team_id, model).inc(billed.prompt)
            m.completion_tokens.labels(ctx.team_id, model).inc(billed.completion)
        if billed.cost:
            m.cost.labels(ctx.team_id, model).inc(femtos_to_usd(billed.cost))
        if outcome.status in ("error", "timeout", "cancelled"):
            m.errors.labels(model, outcome.status, outcome.reason or "unknown").inc()
        sliced = (
            model,
            length_bucket(billed.prompt, PROMPT_BUCKETS),
            length_bucket(billed.completion, OUTPUT_BUCKETS),
        )
        m.e2e.labels(*sliced).observe(e2e)
        if ctx.queue_s is not None:
            m.queue_time.labels(model).observe(ctx.queue_s)
        if ctx.ttft_s is not None:
            m.ttft.labels(*sliced).observe(ctx.ttft_s)
        if tpot is not None:
            m.tpot.labels(*sliced).observe(tpot)
        upstream = (ctx.upstream_end or now) - ctx.dispatched_at if ctx.dispatched_at is not None else 0.0
        m.overhead.observe(max(0.0, e2e - (ctx.queue_s or 0.0) - upstream))
        if outcome.status != "ok":
            log.info(
                "request_not_ok",
                request_id=ctx.request_id,
                team=ctx.team_id,
                model=clip(ctx.model),
                status=outcome.status,
                reason=outcome.reason,
                http_status=outcome.http_status,
            )

    def observe_variant(self, ctx: RequestRecord, tpot: float | None) -> None:
        """A canary is judged by what its own pool did (policies/canary.py `judged`): a request another pool served
        (a fallback, the baseline) or none could be asked to failed there; one refused (by the gateway, or by the
        upstream as the client's error) or cancelled says nothing about it, nor does one steered by the header."""
        if self.rollouts is None or ctx.alias is None or ctx.variant is None or ctx.model is None or ctx.steered:
            return
        ok = judged(ctx.outcome.status, ctx.outcome.reason, ctx.outcome.http_status, ctx.served_model == ctx.model)
        if ok is None:
            return
        ttft, tpot = (ctx.ttft_s, tpot) if ok else (None, None)
        self.rollouts.observe(ctx.alias, ctx.variant, ctx.model, ok, ttft, tpot, ctx.t0)


def unadmitted_record(scope: RequestScope, kind: InferenceKind, err: APIError) -> RequestRecord:
    """The record of a request refused before admission, as its scope knows it."""
    principal = scope.principal
    team = principal.team if principal is not None else None
    gone = err.code == "client_disconnected"
    return RequestRecord(
        request_id=scope.request_id,
        kind=kind,
        t0=scope.t0,
        team_id=team.id if team is not None else None,
        key_id=principal.key.id if principal is not None else None,
        model=scope.model if isinstance(scope.model, str) else None,
        priority=team.limits.priority if team is not None else 0,
        outcome=Outcome("cancelled" if gone else "rejected", err.code, err.status, disconnected=gone),
        batch_id=scope.batch_id,
    )
