"""The request path, as named steps that read in order:

    check_model -> count_prompt -> apply_caps -> reserve -> take_slot -> enter_queue -> dispatch -> finish

Every step either passes or raises an APIError whose `code` is the event's `reason`. `finish` runs exactly once
per request (in a finally, shielded from cancellation; for streams, when the stream ends): it stops the upstream
if it may still be running (engine `/abort`, which returns the exact usage made), gives back the dispatch slot,
the team's concurrency slot and the unused reservation, records usage, and writes the one JSONL event. Each of
those steps has its own guard, so one that raises never skips the ones after it; a settle or a slot release the
shared state cannot take now goes to the outbox and is replayed when it can.

While the shared state is unreachable, reserving answers 503 `state_unavailable` (fail closed), or, with
`state.on_unavailable: fail_open`, admits under this replica's own in-process limits and writes their spend to
the shared state when it returns (through the outbox).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from gateway import relay
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.events import EventWriter
from gateway.http1 import HTTP1Pool, HTTPError
from gateway.logging import get_logger
from gateway.metrics import Metrics
from gateway.outbox import StateOutbox
from gateway.state import InMemoryState, StateUnavailable
from gateway.token_count import TokenCounter, UnsupportedContent
from gateway.upstream import Hop, Upstreams
from policies.budget import day_key
from policies.caps import apply_caps
from policies.decisions import Rejected
from policies.limits import TeamLimits

log = get_logger()

# Client strings copied into events, logs and metric labels are cut to this many characters.
MAX_CLIENT_STRING = 256


@dataclass(eq=False)
class Ctx:
    """Everything one request carries through the steps, and what its event will say."""

    request_id: str
    kind: str  # "chat" | "completions"
    body: dict
    team_id: str
    key_id: str
    limits: TeamLimits
    model: str
    stream: bool
    t0: float  # time.perf_counter() at arrival: every duration is measured on it
    deadline_base: float  # loop.time() at arrival: deadlines are loop-time instants (uvloop's clock ticks in ms)
    priority: int
    client_usage: bool = False
    client_continuous: bool = False
    max_tokens: int | None = None
    prompt_tokens: int = 0
    reservation: object | None = None
    slot: bool = False
    local_state: bool = False  # admitted under this replica's own limits while the shared state was away
    ticket: object | None = None
    queue_s: float | None = None
    hop: Hop | None = None
    served_model: str | None = None  # the pool of the last hop tried: its usage row
    # The id the upstream knows this attempt by (and /abort targets). Never the client's X-Request-Id: two
    # requests, maybe of two teams, could send the same one, and an abort must stop only its own request.
    upstream_id: str = ""
    route: list[str] = field(default_factory=list)
    dispatched_at: float | None = None
    upstream_end: float | None = None
    ttft_s: float | None = None
    usage: dict | None = None
    finish_reason: str | None = None
    incomplete: bool = False  # the upstream may still be generating: abort it in finish
    instance_ok: bool = True
    sse: relay.SSEStream | None = None
    chunks: relay.ChunkFilter | None = None
    status: str = "ok"
    reason: str | None = None
    http_status: int = 200
    disconnected: bool = False
    spilled: list[int] = field(default_factory=lambda: [0, 0])  # tokens made by hops that failed early
    watching: bool = True  # a client disconnect may still cancel the handler

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


class Admission:
    def __init__(
        self,
        config: GatewayConfig,
        upstreams: Upstreams,
        state,
        queues: dict,
        client: HTTP1Pool,
        events: EventWriter,
        metrics: Metrics,
        usage,
        outbox: StateOutbox | None = None,
    ) -> None:
        self.config, self.upstreams, self.state, self.queues = config, upstreams, state, queues
        self.client, self.events, self.metrics, self.usage = client, events, metrics, usage
        self.outbox = outbox
        # fail_open: while the shared state is away, admit under this replica's own counters
        self.local = InMemoryState() if config.state.on_unavailable == "fail_open" else None
        self.state_ready = True  # False until start-up has seeded the shared state's budgets
        self._counters: dict[str, TokenCounter] = {}
        self.seen_teams: set[str] = set()  # whose per-team gauges /metrics refreshes

    def warm(self) -> None:
        """Load every pool's tokenizer now (seconds each), not on the first request."""
        for model in self.upstreams.pools:
            self.counter(model)

    def counter(self, model: str) -> TokenCounter:
        c = self._counters.get(model)
        if c is None:
            c = self._counters[model] = TokenCounter(self.upstreams.pools[model].cfg.tokenizer)
        return c

    async def handle(self, request: Request, principal, body: dict, kind: str) -> Response:
        ctx = self.new_context(request, principal, body, kind)
        request.state.accounted = True  # finish() writes this request's event, whatever happens next
        # A client that leaves while we wait (queue, upstream) cancels this task: nothing keeps running for it.
        task = asyncio.current_task()
        watch = asyncio.ensure_future(_wait_disconnect(request))
        watch.add_done_callback(lambda t: ctx.watching and not t.cancelled() and task.cancel())
        handed_off = False
        try:
            self.check_model(ctx)
            self.count_prompt(ctx)
            self.apply_caps(ctx)
            await self.reserve(ctx)
            await self.take_slot(ctx)
            await self.enter_queue(ctx)
            response = await self.dispatch(ctx)
            handed_off = isinstance(response, relay.StreamResponse)
            return response
        except APIError as e:
            if ctx.status == "ok":
                ctx.status = "rejected" if not ctx.route else "error"  # shed before any upstream saw it
            ctx.reason, ctx.http_status = ctx.reason or e.code, e.status
            raise
        except asyncio.CancelledError:
            ctx.incomplete = ctx.incomplete or ctx.hop is not None
            ctx.status, ctx.http_status, ctx.disconnected = "cancelled", 499, True
            if not (watch.done() and not watch.cancelled()):
                ctx.reason, ctx.http_status, ctx.disconnected = "shutdown", 503, False
                raise  # not the client leaving: the server is shutting down past its grace
            task.uncancel()
            ctx.reason = "client_disconnected"
            return Response(status_code=499)
        except Exception:
            ctx.status, ctx.reason, ctx.http_status = "error", "internal_error", 500
            ctx.incomplete = ctx.incomplete or ctx.hop is not None
            raise
        finally:
            ctx.watching = False
            watch.cancel()
            if not handed_off:
                await relay.shielded(self.finish(ctx))

    def record_unadmitted(self, request: Request, err: APIError) -> None:
        """A request refused before the pipeline (bad key, malformed body, an admin key) still ends as one event."""
        principal = getattr(request.state, "principal", None)
        team = principal.team if principal is not None else None
        model = getattr(request.state, "model", None)
        ctx = Ctx(
            request_id=request.state.request_id,
            kind="chat" if request.url.path.endswith("/chat/completions") else "completions",
            body={},
            team_id=team.id if team is not None else None,
            key_id=principal.key.id if principal is not None else None,
            limits=team.limits if team is not None else None,
            model=model if isinstance(model, str) else None,
            stream=False,
            t0=getattr(request.state, "t0", None) or time.perf_counter(),
            deadline_base=0.0,
            priority=team.limits.priority if team is not None else 0,
            status="cancelled" if err.code == "client_disconnected" else "rejected",
            reason=err.code,
            http_status=err.status,
            disconnected=err.code == "client_disconnected",
        )
        self.emit(ctx, time.perf_counter(), 0, 0, 0)

    # --- the steps --------------------------------------------------------------------------------------------
    def new_context(self, request: Request, principal, body: dict, kind: str) -> Ctx:
        team = principal.team
        if team is None:
            raise APIError(
                403, "This key belongs to no team (admin keys manage the gateway); use a team key.", "no_team"
            )
        self.seen_teams.add(team.id)
        limits = team.limits
        priority = limits.priority
        asked = body.get("priority")
        if isinstance(asked, int) and not isinstance(asked, bool):
            priority = max(priority, asked)  # a request may lower its own priority, never raise it above its team's
        opts = body.get("stream_options") or {}
        return Ctx(
            request_id=request.state.request_id,
            kind=kind,
            body=body,
            team_id=team.id,
            key_id=principal.key.id,
            limits=limits,
            model=body["model"],
            stream=bool(body.get("stream")),
            t0=time.perf_counter(),
            deadline_base=asyncio.get_running_loop().time(),
            priority=priority,
            client_usage=bool(opts.get("include_usage")),
            client_continuous=bool(opts.get("continuous_usage_stats")),
        )

    def check_model(self, ctx: Ctx) -> None:
        if ctx.model not in self.upstreams.pools:
            raise APIError(
                404,
                f"The model '{ctx.model}' does not exist or you do not have access to it.",
                "model_not_found",
                param="model",
            )
        if not ctx.limits.allows_model(ctx.model):
            raise APIError(403, f"Your team may not use the model '{ctx.model}'.", "model_not_allowed", param="model")

    def count_prompt(self, ctx: Ctx) -> None:
        counter = self.counter(ctx.model)
        if ctx.kind != "chat":
            ctx.prompt_tokens = counter.count_prompt(ctx.body["prompt"])
            return
        pool = self.upstreams.pools[ctx.model].cfg
        # Our engines read text only; an external pool bills non-text parts its own way: reserve an upper bound.
        part_tokens = None if all(u.engine for u in pool.upstreams) else pool.non_text_part_tokens
        try:
            ctx.prompt_tokens = counter.count_chat(ctx.body["messages"], part_tokens)
        except UnsupportedContent as e:
            raise APIError(
                400,
                f"The model '{ctx.model}' takes text only: content part type '{e.part_type}' is not supported.",
                "unsupported_content",
                param=e.param,
            ) from None

    def apply_caps(self, ctx: Ctx) -> None:
        body = ctx.body
        requested = body.get("max_completion_tokens") or body.get("max_tokens")
        pool = self.upstreams.pools[ctx.model].cfg
        cap = apply_caps(
            ctx.prompt_tokens,
            requested,
            max_prompt_tokens=ctx.limits.max_prompt_tokens,
            max_output_tokens=ctx.limits.max_output_tokens,
            context_window=pool.max_context,
        )
        if not cap.ok:
            ctx.reason = cap.error.reason  # "too_long" in the event; OpenAI's code for the client
            raise APIError(400, cap.error.message, "context_length_exceeded", param=cap.error.param)
        max_tokens = cap.max_tokens
        if requested is None and ctx.limits.max_output_tokens is None:
            # Nothing but the context bounds it: reserve the gateway default, not the whole context window.
            max_tokens = min(max_tokens or self.config.default_max_tokens, self.config.default_max_tokens)
        ctx.max_tokens = max_tokens or self.config.default_max_tokens
        # The upstream must never make more than we reserved for.
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        body[key] = ctx.max_tokens

    async def reserve(self, ctx: Ctx) -> None:
        try:
            try:
                if not self.state_ready:
                    raise StateUnavailable("the shared state is not seeded yet")
                reserve = self.state.reserve(ctx.team_id, ctx.limits, ctx.prompt_tokens, ctx.max_tokens)
                ctx.reservation = await self.taking(reserve, lambda r: self.state.settle(r, 0, 0), ctx)
            except StateUnavailable as e:
                self.defer(e)
                if self.local is None:
                    raise self.state_unavailable(e) from None
                log.warning("state_unavailable_fail_open", error=str(e))
                ctx.local_state = True
                ctx.reservation = await self.local.reserve(ctx.team_id, ctx.limits, ctx.prompt_tokens, ctx.max_tokens)
        except Rejected as r:
            raise _api_error(r) from None

    def state_unavailable(self, err: Exception) -> APIError:
        log.warning("state_unavailable", error=str(err))
        retry = self.config.state.retry_after_s
        return APIError(
            503,
            f"The gateway cannot reach its shared limits state; retry in {retry}s.",
            "state_unavailable",
            headers={"retry-after": str(retry)},
        )

    async def take_slot(self, ctx: Ctx) -> None:
        state = self.local if ctx.local_state else self.state
        try:
            acquire = state.acquire_slot(ctx.team_id, ctx.limits.max_concurrency)
            got = await self.taking(acquire, lambda _: state.release_slot(ctx.team_id), ctx)
        except StateUnavailable as e:
            self.defer(e)
            raise self.state_unavailable(e) from None
        if not got:
            raise APIError(
                429,
                f"Too many requests in flight: your team may run {ctx.limits.max_concurrency} at once. "
                "Retry when one finishes.",
                "concurrency",
                headers={"retry-after": "1"},
            )
        ctx.slot = True

    async def enter_queue(self, ctx: Ctx) -> None:
        timeout = ctx.limits.queue_timeout_s or self.config.timeouts.queue_s
        try:
            ctx.ticket = await self.queues[ctx.model].acquire(ctx.team_id, ctx.priority, ctx.limits.weight, timeout)
        except Rejected as r:
            raise _api_error(r) from None
        ctx.queue_s = ctx.ticket.queue_s

    async def dispatch(self, ctx: Ctx) -> Response:
        hops = self.upstreams.plan(ctx.model)
        last = "every instance's circuit is open"
        for hop in hops:
            ctx.route.append(hop.label)
            ctx.hop, ctx.instance_ok, ctx.dispatched_at = hop, True, time.perf_counter()
            ctx.served_model = hop.model
            ctx.upstream_id = "tw-" + uuid.uuid4().hex
            hop.instance.take(time.monotonic())
            self.metrics.in_flight.labels(ctx.model).inc()
            try:
                if ctx.stream:
                    return await self.open_stream(ctx, hop)
                return await self.call(ctx, hop)
            except relay.UpstreamFailed as e:
                last, ctx.incomplete = str(e), False
                if hop.instance.cfg.engine:
                    # The request may have reached the engine (a stream that failed before its first token, a
                    # connection lost after sending): stop it and keep what it counted, so the bill still
                    # matches the engine's counters.
                    answer = await relay.abort(self.client, hop, ctx.upstream_id)
                    usage = (answer or {}).get("usage") or {}
                    ctx.spilled[0] += int(usage.get("prompt_tokens") or 0)
                    ctx.spilled[1] += int(usage.get("completion_tokens") or 0)
                ctx.chunks = None  # its usage, if any, is in `spilled` now
                self.release_hop(ctx, ok=False)
                await self.close_stream(ctx)
            except relay.UpstreamRejected as e:
                ctx.incomplete = False
                ctx.usage = {"prompt_tokens": 0, "completion_tokens": 0}  # refused: nothing was made
                ctx.status, ctx.reason, ctx.http_status = "error", "upstream_rejected", e.status
                return Response(e.body, e.status, media_type="application/json")
        ctx.reason = "upstream_unavailable"
        raise APIError(
            503,
            f"No upstream could serve '{ctx.model}' ({last}). Retry shortly.",
            "upstream_unavailable",
            headers={"retry-after": str(max(1, int(self.config.breaker.cooldown_s)))},
        )

    # --- dispatch, non-stream and stream -----------------------------------------------------------------------
    def timeouts(self, ctx: Ctx) -> tuple[float, float]:
        pool, t = self.upstreams.pools[ctx.model].cfg, self.config.timeouts
        ttft = _tightest(ctx.limits.ttft_timeout_s, pool.ttft_timeout_s) or t.ttft_s
        total = _tightest(ctx.limits.total_timeout_s, pool.total_timeout_s) or t.total_s
        return ttft, total

    def instance_too_slow(self, ctx: Ctx, kind: str) -> bool:
        """A timeout counts against the instance's circuit only when the pool's own limit fired: a hung upstream must
        be routed around, but a team's tighter limit says nothing about the instance other teams share."""
        pool, defaults = self.upstreams.pools[ctx.model].cfg, self.config.timeouts
        team_limit = getattr(ctx.limits, f"{kind}_timeout_s")
        pool_limit = getattr(pool, f"{kind}_timeout_s") or getattr(defaults, f"{kind}_s")
        return not team_limit or team_limit >= pool_limit

    def upstream_body(self, ctx: Ctx, hop: Hop) -> dict:
        if hop.instance.cfg.engine:  # the engine schedules by the priority admission decided, never the client's
            return {**ctx.body, "priority": ctx.priority}
        return ctx.body

    async def call(self, ctx: Ctx, hop: Hop) -> Response:
        _, total = self.timeouts(ctx)
        ctx.incomplete = hop.instance.cfg.engine
        body = self.upstream_body(ctx, hop)
        try:
            obj, raw = await relay.call_json(
                self.client, hop, ctx.path, body, ctx.upstream_id, ctx.deadline_base + total
            )
        except TimeoutError:
            ctx.status, ctx.reason = "timeout", "timeout"
            ctx.instance_ok = not self.instance_too_slow(ctx, "total")
            raise APIError(504, f"The upstream did not answer within {total:g}s.", "timeout") from None
        finally:
            ctx.upstream_end = time.perf_counter()
        ctx.incomplete = False
        ctx.ttft_s = ctx.upstream_end - ctx.dispatched_at
        ctx.usage = obj.get("usage")
        choices = obj.get("choices") or [{}]
        ctx.finish_reason = choices[0].get("finish_reason")
        return Response(raw, 200, headers=_rate_headers(ctx), media_type="application/json")

    async def open_stream(self, ctx: Ctx, hop: Hop) -> Response:
        loop = asyncio.get_running_loop()
        ttft, total = self.timeouts(ctx)
        first_deadline = min(loop.time() + ttft, ctx.deadline_base + total)
        ctx.incomplete = hop.instance.cfg.engine
        chunks = ctx.chunks = relay.ChunkFilter(
            ctx.client_usage, ctx.client_continuous, not hop.instance.cfg.engine, time.perf_counter
        )
        first: list[bytes] = []
        try:
            ctx.sse = await relay.open_stream(
                self.client, hop, ctx.path, self.upstream_body(ctx, hop), ctx.upstream_id, first_deadline
            )
            while chunks.first_token_at is None and not chunks.done:
                data = await ctx.sse.next(first_deadline)
                if data is None:
                    raise relay.UpstreamFailed(f"{hop.label}: the stream ended before its first event")
                if chunks.error is not None:
                    raise relay.UpstreamFailed(f"{hop.label}: {chunks.error.get('message')}")
                out = chunks.process(data)
                if chunks.error is not None:
                    raise relay.UpstreamFailed(f"{hop.label}: {chunks.error.get('message')}")
                if out is not None:
                    first.append(out)
        except TimeoutError:
            ctx.status, ctx.reason = "timeout", "timeout"
            first_token = loop.time() < ctx.deadline_base + total
            which, limit = ("first token", ttft) if first_token else ("response", total)
            ctx.instance_ok = not self.instance_too_slow(ctx, "ttft" if first_token else "total")
            raise APIError(504, f"The upstream did not send a {which} within {limit:g}s.", "timeout") from None
        except HTTPError as e:
            raise relay.UpstreamFailed(f"{hop.label}: {type(e).__name__}") from e
        ctx.ttft_s = (chunks.first_token_at or time.perf_counter()) - ctx.dispatched_at
        deadline = ctx.deadline_base + total

        async def pump(send) -> bool:
            return await self.pump(ctx, first, deadline, send)

        async def done(disconnected: bool, shutdown: bool) -> None:
            ctx.disconnected = ctx.disconnected or disconnected
            if disconnected and ctx.status == "ok":
                ctx.status, ctx.reason, ctx.http_status, ctx.incomplete = "cancelled", "client_disconnected", 499, True
            elif shutdown and ctx.status == "ok":
                ctx.status, ctx.reason, ctx.http_status, ctx.incomplete = "cancelled", "shutdown", 503, True
            await self.finish(ctx)

        return relay.StreamResponse(pump, done, _rate_headers(ctx))

    async def pump(self, ctx: Ctx, first: list[bytes], deadline: float, send) -> bool:
        """Relay the rest of the stream. False if the client went away (a send failed)."""
        chunks, sse = ctx.chunks, ctx.sse
        tail = b""
        try:
            await send({"type": "http.response.body", "body": b"".join(first), "more_body": True})
            pending: list[bytes] = []  # events that arrived together leave together: one write, not several
            try:
                async with asyncio.timeout_at(deadline):  # one timer for the whole stream, not one per chunk
                    while not chunks.done:
                        data = await sse.next()
                        if data is None:
                            break
                        out = chunks.process(data)
                        if out is not None:
                            pending.append(out)
                        if pending and not sse.buffered and not chunks.done:
                            await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
                            pending.clear()
            except TimeoutError:
                ctx.status, ctx.reason, ctx.http_status, ctx.incomplete = "timeout", "timeout", 504, True
                tail = relay.sse_error("The response timed out upstream.", "timeout", "timeout_error")
            except HTTPError:  # the upstream connection broke mid-body
                pass
            if chunks.done:
                ctx.incomplete = False
            elif ctx.status != "timeout":
                ctx.status, ctx.reason, ctx.http_status, ctx.incomplete = "error", "upstream_broken", 502, True
                ctx.instance_ok = False
                tail = relay.sse_error("The upstream stream broke off.", "upstream_broken", "upstream_error")
            ctx.upstream_end = time.perf_counter()
            await send({"type": "http.response.body", "body": b"".join(pending) + tail, "more_body": False})
            return True
        except OSError:
            return False

    # --- the end of every request ---------------------------------------------------------------------------
    def release_hop(self, ctx: Ctx, ok: bool) -> None:
        if ctx.hop is not None:
            ctx.hop.instance.done(ok, time.monotonic())
            self.metrics.in_flight.labels(ctx.model).dec()
            ctx.hop = None

    async def close_stream(self, ctx: Ctx) -> None:
        if ctx.sse is not None:
            sse, ctx.sse = ctx.sse, None
            if ctx.chunks is not None and ctx.chunks.done and not ctx.incomplete:
                await sse.drain()  # read to the end of the body so the keep-alive connection goes back to the pool
            await sse.aclose()

    async def finish(self, ctx: Ctx) -> None:
        hop = ctx.hop
        try:
            # 1) Stop an upstream that may still be generating; our engine answers with the exact usage made.
            if hop is not None and ctx.incomplete and hop.instance.cfg.engine:
                answer = await relay.abort(self.client, hop, ctx.upstream_id)
                if answer and answer.get("usage"):
                    ctx.usage = answer["usage"]
            await self.close_stream(ctx)
        except Exception:  # noqa: BLE001 - whatever broke here, the bill and the slots below must still happen
            log.exception("finish_upstream_cleanup_failed", request_id=ctx.request_id)
        # 2) Slots back, then settle and account: each step guarded, so none is skipped because another raised.
        if ctx.ticket is not None:
            self._guard(self.queues[ctx.model].release, ctx.ticket)
        state = self.local if ctx.local_state else self.state
        if ctx.slot:
            ctx.slot = False
            await self._state_change(state.release_slot(ctx.team_id), ctx)
        try:
            prompt, completion, cached = self.billable(ctx)
        except Exception:  # noqa: BLE001 - never drop a bill: fall back to what was counted at admission
            log.exception("finish_billable_failed", request_id=ctx.request_id)
            prompt, completion, cached = ctx.prompt_tokens if ctx.route else 0, 0, 0
        if hop is not None:
            self._guard(self.release_hop, ctx, ctx.instance_ok)
        ts = time.time()
        if ctx.reservation is not None:
            await self._state_change(state.settle(ctx.reservation, prompt, completion, ts), ctx)
            if ctx.local_state and self.outbox is not None:
                # Admitted while the shared state was away: its spend reaches the shared budgets when it returns.
                op = {"op": "settle", "team_id": ctx.team_id, "res_id": "local-" + uuid.uuid4().hex}
                self.outbox.put(op | {"tokens": prompt + completion, "now": ts})
        self._guard(self.record, ctx, ts, prompt, completion, cached)

    def record(self, ctx: Ctx, ts: float, prompt: int, completion: int, cached: int) -> None:
        """The request's one event and, if an upstream was tried, its usage row (the event first: it is the
        write-ahead record that start-up replays when a crash kept the usage row out of the store)."""
        seq = self.emit(ctx, time.perf_counter(), prompt, completion, cached, ts)
        if ctx.route:
            model = ctx.served_model or ctx.model
            self.usage.add(ctx.team_id, model, prompt, completion, cached, day=day_key(ts), seq=seq)

    async def taking(self, call, give_back, ctx: Ctx):
        """Await a state call that takes something (a hold, a slot). If the client leaves meanwhile, the call still
        completes, and what it took is given back: a cancelled round trip must not leave a hold or a lease
        behind until its expiry."""
        task = relay.spawn(call)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:

            def undo(t: asyncio.Task) -> None:
                if t.cancelled():
                    return
                if isinstance(t.exception(), StateUnavailable):
                    self.defer(t.exception())
                elif t.exception() is None and t.result():
                    relay.spawn(self._state_change(give_back(t.result()), ctx))

            task.add_done_callback(undo)
            raise

    def defer(self, err: StateUnavailable) -> None:
        """Keep the change a failed state call still owes (a settle, a release, an undo) for the outbox."""
        if err.pending is not None and self.outbox is not None:
            self.outbox.put(err.pending)

    async def _state_change(self, change, ctx: Ctx) -> None:
        try:
            await change
        except StateUnavailable as e:
            self.defer(e)
            log.warning("state_change_deferred", request_id=ctx.request_id, error=str(e))
        except Exception:  # noqa: BLE001
            log.exception("state_change_failed", request_id=ctx.request_id)

    @staticmethod
    def _guard(step, *args) -> None:
        try:
            step(*args)
        except Exception:  # noqa: BLE001 - one failed step must not skip the others
            log.exception("finish_step_failed", step=getattr(step, "__name__", str(step)))

    def billable(self, ctx: Ctx) -> tuple[int, int, int]:
        """What the request cost: the upstream's own usage when it reported one, else our count; plus what
        hops that failed before the first token had already made."""
        prompt, completion, cached = self._billable(ctx)
        return prompt + ctx.spilled[0], completion + ctx.spilled[1], cached

    def _billable(self, ctx: Ctx) -> tuple[int, int, int]:
        usage = ctx.usage or (ctx.chunks.usage if ctx.chunks is not None else None)
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            cached = usage.get("cached_tokens") or (details.get("cached_tokens") if isinstance(details, dict) else 0)
            return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0), int(cached or 0)
        if ctx.hop is None or ctx.dispatched_at is None:
            return 0, 0, 0  # never reached an upstream
        # An external upstream cut off before its usage chunk: count the text it relayed (a documented estimate).
        completion = 0
        if ctx.chunks is not None and ctx.chunks.text:
            completion = self.counter(ctx.model).count_text("".join(ctx.chunks.text))
        return ctx.prompt_tokens, completion, 0

    def emit(self, ctx: Ctx, now: float, prompt: int, completion: int, cached: int, ts: float | None = None) -> int:
        e2e = now - ctx.t0
        tpot = None
        chunks = ctx.chunks
        if chunks is not None and chunks.first_token_at is not None and completion > 1:
            tpot = (chunks.last_token_at - chunks.first_token_at) / (completion - 1)
        if ctx.finish_reason is None and chunks is not None:
            ctx.finish_reason = chunks.finish_reason
        seq = self.events.emit(
            {
                "ts": ts or time.time(),
                "request_id": ctx.request_id,
                "team": ctx.team_id,
                "key_id": ctx.key_id,
                "model": clip(ctx.model),
                "served_model": ctx.served_model,
                "route": ctx.route,
                "upstream_request_id": ctx.upstream_id or None,
                "instance": ctx.route[-1] if ctx.route else None,
                "priority": ctx.priority,
                "status": ctx.status,
                "reason": ctx.reason,
                "http_status": ctx.http_status,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "cached_tokens": cached,
                "max_tokens": ctx.max_tokens,
                "queue_ms": _ms(ctx.queue_s),
                "ttft_ms": _ms(ctx.ttft_s),
                "tpot_ms": _ms(tpot),
                "e2e_ms": _ms(e2e),
                "finish_reason": ctx.finish_reason,
                "stream": ctx.stream,
                "client_disconnected": ctx.disconnected,
            }
        )
        m = self.metrics
        # Label values come from clients (a made-up model name, no team at all): keep their number bounded.
        model = ctx.model if ctx.model in self.upstreams.pools else "unknown"
        m.requests.labels(ctx.team_id or "none", model, ctx.status).inc()
        if ctx.status == "rejected":
            m.rejections.labels(ctx.reason or "unknown").inc()
        if prompt or completion:
            m.prompt_tokens.labels(ctx.team_id, model).inc(prompt)
            m.completion_tokens.labels(ctx.team_id, model).inc(completion)
        m.e2e.labels(model).observe(e2e)
        if ctx.queue_s is not None:
            m.queue_time.labels(model).observe(ctx.queue_s)
        if ctx.ttft_s is not None:
            m.ttft.labels(model).observe(ctx.ttft_s)
        if tpot is not None:
            m.tpot.labels(model).observe(tpot)
        upstream = (ctx.upstream_end or now) - ctx.dispatched_at if ctx.dispatched_at is not None else 0.0
        m.overhead.observe(max(0.0, e2e - (ctx.queue_s or 0.0) - upstream))
        if ctx.status != "ok":
            log.info(
                "request_not_ok",
                request_id=ctx.request_id,
                team=ctx.team_id,
                model=clip(ctx.model),
                status=ctx.status,
                reason=ctx.reason,
                http_status=ctx.http_status,
            )
        return seq


def _api_error(r: Rejected) -> APIError:
    return APIError(r.status, r.message, r.reason, headers=r.headers)


def clip(value: str | None) -> str | None:
    """A client string as it may appear in an event, a log line or a label."""
    if isinstance(value, str) and len(value) > MAX_CLIENT_STRING:
        return value[:MAX_CLIENT_STRING] + "..."
    return value


def _rate_headers(ctx: Ctx) -> dict[str, str]:
    """x-ratelimit-* as of the reservation, on successful responses too (as OpenAI sends them)."""
    return dict(getattr(ctx.reservation, "headers", None) or {})


def _tightest(*values: float | None) -> float | None:
    present = [v for v in values if v]
    return min(present) if present else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def new_request_id(client_value: str | None) -> str:
    """Honour a client's X-Request-Id when it is sane (short, printable, no spaces); else mint one."""
    sane = client_value and len(client_value) <= 128 and client_value.isascii() and client_value.isprintable()
    if sane and " " not in client_value:
        return client_value
    return "req-" + uuid.uuid4().hex
