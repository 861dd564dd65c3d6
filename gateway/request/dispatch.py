"""Dispatch: try the route plan's hops in order (the pool's instances as its route strategy ranks them, then each
fallback pool's) until one answers; a hop that fails before the first byte passes to the next and counts against its
instance's circuit. Non-stream calls and streams (first token under the TTFT deadline, then relayed chunk by
chunk under the total deadline) go through gateway/request/relay.py; what they made is settled by
gateway/request/settle.py, through the request's end (gateway/request/request_end.py): dispatch hangs the open
stream of a hop on it, and hands it to the stream response it returns.
"""

from __future__ import annotations

import asyncio
import random
import time

from fastapi.responses import Response
from starlette.types import Send

from tokenweir.common.http.errors import APIError
from tokenweir.common.ids import random_hex
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.config import GatewayConfig
from tokenweir.gateway.openai.endpoints import KIND_PATHS
from tokenweir.gateway.openai.prompt_ids import head_tokens, prompt_token_ids
from tokenweir.gateway.request import deadlines, relay
from tokenweir.gateway.request.cache_scope import request_salt, with_salt
from tokenweir.gateway.request.context import RequestContext
from tokenweir.gateway.request.request_end import RequestEnd
from tokenweir.gateway.request.settle import Settler
from tokenweir.gateway.request.shadow import ShadowMirror
from tokenweir.gateway.request.sse_reader import EventTooLarge
from tokenweir.gateway.request.stream_chunks import ChunkFilter, generated_text
from tokenweir.gateway.request.variant_choice import baseline_hops
from tokenweir.gateway.upstream.client import HTTPError, UpstreamClient
from tokenweir.gateway.upstream.pools import Hop, Upstreams

# try_hop's answer for a hop it did not try: its member serves max_parallel_requests already, or left the table
UNTRIED = "its member is full or gone"


class Dispatcher:
    def __init__(
        self, config: GatewayConfig, upstreams: Upstreams, client: UpstreamClient, metrics: Metrics, settler: Settler
    ) -> None:
        self.config, self.upstreams, self.client, self.metrics, self.settler = (
            config,
            upstreams,
            client,
            metrics,
            settler,
        )
        self.shadow = ShadowMirror(config, client, metrics, settler.members, settler.background)

    def route(self, ctx: RequestContext) -> tuple[list[Hop], list[int]]:
        """The route plan (its first hop chosen by the pool's strategy), the decision on ctx and in metrics, and the
        prompt's block hashes for the prefix index."""
        target = ctx.context_fallback or ctx.model  # the pool whose context fits the prompt
        pool = ctx.pools[target]
        token_ids, head = None, 0
        if pool.cfg.strategy == "prefix" and ctx.kind != "embeddings":  # an embedding leaves no KV cache behind
            token_ids = prompt_token_ids(pool.cfg.tokenizer, ctx.kind, ctx.body)
            if token_ids and ctx.kind == "chat":
                head = head_tokens(pool.cfg.tokenizer, ctx.body, token_ids)
        salt = request_salt(ctx, target)  # the engine keys its cache by it: the index must too
        hops, why, hashes = self.upstreams.route(target, token_ids, ctx.model, ctx.routes, head, salt)
        hops += baseline_hops(ctx, self.upstreams, hops)  # a rollout's canary: its baseline last
        if ctx.kind == "embeddings":  # a fallback pool that serves no embeddings is no hop for them
            hops = [h for h in hops if ctx.pools[h.model].serves_embeddings]
        elif pool.prefill_members:
            ctx.prefill_hops, _ = self.upstreams.prefill_route(target, token_ids, ctx.routes, head, salt)
        ctx.route_reason = why.as_dict()
        if ctx.context_fallback is not None:
            ctx.route_reason["context_window_fallback"] = ctx.context_fallback
        self.metrics.routing_decisions.labels(ctx.model, why.reason).inc()
        if why.reason.startswith("prefix_"):  # the prompt's hashes were looked up (not a fallback to load)
            self.metrics.routing_prefix_hit_blocks.labels(ctx.model).observe(why.hit_blocks)
        return hops, hashes

    async def dispatch(self, ctx: RequestContext, end: RequestEnd) -> Response:
        """The answer of the first hop that gives one; with `retries`, the plan again after a backoff when every hop
        failed before its first byte. A stream's response carries the request's `end` (its body settles the
        request); any other answer, or an exception, leaves the end to the handler."""
        hops, hashes = self.route(ctx)
        end.on_settled = self.shadow.sample(ctx)  # a mirror, sent once the request has ended and been billed
        if ctx.prefill_hops:
            await self.prefill(ctx, hashes)
            if ctx.stream and asyncio.get_running_loop().time() >= deadlines.first_token_deadline(self.config, ctx):
                # the prefill hop spent the whole TTFT budget: no decode hop could send a first token in time
                if ctx.prefill_pin is not None:
                    self.release_prefill(ctx)
                ctx.outcome.decide("timeout", "ttft_timeout", 504)
                limit = deadlines.limits(self.config, ctx)[0]
                raise APIError(504, f"The upstream did not send a first token within {limit:g}s.", "timeout")
        last = "every instance's circuit is open"
        for attempt in range(1 + ctx.pools[ctx.model].cfg.retries):
            if attempt:
                if not await self.back_off(ctx, attempt):
                    break
                hops = self.retry_plan(ctx)
                self.metrics.retries.labels(ctx.model).inc()
            waits = 0
            while True:
                tried = False
                for hop in hops:
                    answer = await self.try_hop(ctx, hop, end, hashes)
                    if isinstance(answer, Response):
                        return answer
                    if answer is not UNTRIED:
                        tried, last = True, answer
                if tried or not hops:
                    break
                waits += 1  # every member serves its max_parallel_requests: wait for one to finish, then ask again
                await self.wait_for_member(ctx, waits)
                if any(h.instance.removed for h in hops):  # the routing table changed meanwhile: its members now
                    hops = self.retry_plan(ctx)
        if ctx.prefill_pin is not None:
            self.release_prefill(ctx)
        raise APIError(
            503,
            f"No upstream could serve '{ctx.model}' ({last}). Retry shortly.",
            "upstream_unavailable",
            headers={"retry-after": str(max(1, int(self.config.breaker.cooldown_s)))},
        )

    async def try_hop(self, ctx: RequestContext, hop: Hop, end: RequestEnd, hashes: list[int]) -> Response | str:
        """The hop's answer, or why it failed before its first byte (the next hop, or a retry, may serve it);
        UNTRIED, without trying it, when its member serves max_parallel_requests already or has left the routing table
        (removed since the plan was made: it gets nothing new)."""
        if hop.instance.removed:
            return UNTRIED
        cap = hop.instance.cfg.max_parallel_requests
        if cap is not None:
            lease = await self.settler.members.take(hop.instance.cfg.base_url, cap)
            if lease is None:
                return UNTRIED
            ctx.member_lease = (hop.instance.cfg.base_url, lease)
        if ctx.prefill_pin is not None and not self.takes_kv(ctx, hop):
            self.release_prefill(ctx)  # a hop that computes the prompt itself: nobody will fetch the KV
        deadlines.start_ttft_clock(ctx)  # the first hop out starts it; a later one spends what is left
        ctx.route.append(hop.label)
        ctx.hop, ctx.instance_ok, ctx.dispatched_at = hop, True, time.perf_counter()
        ctx.served_model, ctx.model_revision = hop.model, hop.instance.revision
        ctx.upstream_id = "tw-" + random_hex()
        if ctx.trace is not None:
            ctx.trace.start_hop("hop", hop)
        self.settler.dispatched(ctx, hop)  # journaled: a worker killed from here on still bills what it made
        hop.instance.take(time.monotonic())
        self.upstreams.record(hop, hashes)
        self.metrics.in_flight.labels(ctx.model).inc()
        try:
            if ctx.stream:
                return await self.open_stream(ctx, hop, end)
            return await self.call(ctx, hop)
        except relay.UpstreamFailed as e:
            ctx.incomplete = False
            if hop.instance.cfg.engine:
                # The request may have reached the engine (a stream that failed before its first token, a
                # connection lost after sending): stop it and keep what it counted, so the bill still
                # matches the engine's counters.
                answer = await relay.abort(self.client, hop, ctx.upstream_id)
                usage = (answer or {}).get("usage") or {}
                ctx.spilled_prompt_tokens += int(usage.get("prompt_tokens") or 0)
                ctx.spilled_completion_tokens += int(usage.get("completion_tokens") or 0)
            if ctx.trace is not None:
                ctx.trace.end_hop("failed", str(e))
            self.settler.release_hop(ctx, ok=False)
            await end.drop_stream()  # its usage, if any, is in `spilled` now
            return str(e)
        except relay.UpstreamRejected as e:
            ctx.incomplete = False
            # Refused before running: nothing was made. An engine may have failed the request part-way (a
            # grammar it could not follow): it counted what it made, and the bill says the same.
            ctx.usage = {"prompt_tokens": 0, "completion_tokens": 0}
            if hop.instance.cfg.engine:
                usage = ((await relay.abort(self.client, hop, ctx.upstream_id)) or {}).get("usage") or {}
                ctx.usage = {k: int(usage.get(k) or 0) for k in ("prompt_tokens", "completion_tokens")}
                ctx.usage_source = "engine_abort"
            await end.drop_stream()
            if ctx.trace is not None:
                ctx.trace.end_hop("rejected", f"{hop.label}: HTTP {e.status}")
            ctx.outcome.decide("error", "upstream_rejected", e.status)
            return Response(e.body, e.status, media_type="application/json")

    async def back_off(self, ctx: RequestContext, attempt: int) -> bool:
        """Wait before retry `attempt` (exponential, with jitter: replicas that failed together do not come back
        together); False, without waiting, if the wait would pass the request's deadline (its first token's, for a
        stream: the hops before spent that budget, the retry does not restart it)."""
        pool = ctx.pools[ctx.model].cfg
        delay = pool.retry_backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.0)
        if asyncio.get_running_loop().time() + delay >= deadlines.answer_deadline(self.config, ctx):
            return False
        await asyncio.sleep(delay)
        return True

    async def wait_for_member(self, ctx: RequestContext, waits: int) -> None:
        """Every member of the plan is full (max_parallel_requests, counted across replicas): wait a little (growing
        to 100 ms, with jitter: replicas waiting together do not ask together); past the request's queue timeout,
        429 queue_timeout as from the dispatch queue. Polling, not a wake-up: the slot may free on another replica."""
        loop = asyncio.get_running_loop()
        queue_s = ctx.limits.queue_timeout_s or self.config.timeouts.queue_s
        delay = min(0.1, 0.005 * 2**waits) * random.uniform(0.5, 1.0)
        if loop.time() + delay >= ctx.deadline_base + queue_s:
            ctx.outcome.decide("rejected", "queue_timeout", 429)
            raise APIError(
                429,
                f"Timed out after {queue_s:g}s waiting for capacity: every instance of '{ctx.model}' serves as many "
                "requests as it may. Retry shortly.",
                "queue_timeout",
                headers={"retry-after": "1"},
            )
        await asyncio.sleep(delay)

    def retry_plan(self, ctx: RequestContext) -> list[Hop]:
        """The route plan again, ranked by load now (the prompt's prefix home failed a moment ago)."""
        hops, _, _ = self.upstreams.route(ctx.context_fallback or ctx.model, None, ctx.model, ctx.routes)
        hops += baseline_hops(ctx, self.upstreams, hops)
        if ctx.kind == "embeddings":
            hops = [h for h in hops if ctx.pools[h.model].serves_embeddings]
        return hops

    async def prefill(self, ctx: RequestContext, hashes: list[int]) -> None:
        """A disaggregated pool: the prompt computed on a prefill member (max_tokens 1, its KV kept there for the
        decode member, which fetches it), under the request's TTFT clock, which starts here and goes on running
        through the decode hop. Its answer's kv_transfer_params go with the decode hop. A prefill member that fails,
        refuses or is late leaves the prompt to the decode member (as a colocated hop). The hop's own token is not the
        client's: the engines count it, the bill does not (the event names the prefill member)."""
        loop = asyncio.get_running_loop()
        deadlines.start_ttft_clock(ctx)
        deadline = deadlines.first_token_deadline(self.config, ctx)
        body = {**self.upstream_body(ctx, ctx.prefill_hops[0]), "max_tokens": 1, "n": 1, "stream": False}
        body["kv_transfer_params"] = {"do_remote_decode": True}
        for key in ("max_completion_tokens", "stream_options", "best_of"):
            body.pop(key, None)
        for hop in (h for h in ctx.prefill_hops if not h.instance.removed):  # checked as each goes out
            started, failed = time.perf_counter(), False
            upstream_id = "tw-" + random_hex()
            hop.instance.take(time.monotonic())
            traceparent = None
            if ctx.trace is not None:
                ctx.trace.start_hop("prefill_hop", hop)
                traceparent = ctx.trace.hop_traceparent
            try:
                answer, _ = await relay.call_json(
                    self.client, hop, KIND_PATHS[ctx.kind], body, upstream_id, deadline, traceparent
                )
            except (relay.UpstreamFailed, TimeoutError) as e:
                failed = True
                ctx.upstream_error = f"prefill {hop.where}: {e or 'timed out'}"
                if ctx.trace is not None:
                    ctx.trace.end_hop("failed", str(e) or f"{hop.label}: timed out")
                self.stop_prefill(hop, upstream_id)
                if loop.time() >= deadline:
                    break
                continue
            except relay.UpstreamRejected:
                if ctx.trace is not None:
                    ctx.trace.end_hop("rejected")
                return  # the request itself is refused: the decode hop answers the client why
            except asyncio.CancelledError:  # the client went away (or the server stops): the engine stops too
                self.stop_prefill(hop, upstream_id)
                raise
            finally:
                hop.instance.done(not failed, time.monotonic())
            params = answer.get("kv_transfer_params")
            kept = isinstance(params, dict) and params.get("do_remote_prefill")
            if ctx.trace is not None:
                ctx.trace.end_hop("ok" if kept else "no_kv")
            if kept:
                ctx.kv_transfer_params, ctx.prefill_instance = params, hop.label
                ctx.prefill_pin = (hop, upstream_id)
                ctx.prefill_s = time.perf_counter() - started
                self.metrics.prefill_time.labels(ctx.model, hop.instance.name).observe(ctx.prefill_s)
                self.upstreams.record(hop, hashes)
                return
            break  # a member that keeps no KV (not a kv_producer): the decode member computes the prompt
        self.metrics.prefill_fallbacks.labels(ctx.model).inc()

    def takes_kv(self, ctx: RequestContext, hop: Hop) -> bool:
        """The hop fetches the prompt's KV the prefill hop left (a decode member of the requested pool)."""
        return ctx.kv_transfer_params is not None and hop.instance.cfg.role == "decode" and not hop.fallback

    def release_prefill(self, ctx: RequestContext) -> None:
        """No decode hop will fetch the prefill hop's KV: its engine lets the blocks go now, not at the pin's
        timeout."""
        assert ctx.prefill_pin is not None
        hop, upstream_id = ctx.prefill_pin
        ctx.prefill_pin, ctx.kv_transfer_params = None, None
        self.stop_prefill(hop, upstream_id)

    def stop_prefill(self, hop: Hop, upstream_id: str) -> None:
        """Abort a prefill hop the request no longer waits for, or whose KV nobody will fetch, in the background (it
        must not delay the next hop or a cancellation): its engine stops computing the prompt, or lets its pinned
        blocks go. The prefill hop's tokens are the route's, never billed."""
        if hop.instance.cfg.engine:
            self.settler.background.spawn(relay.abort(self.client, hop, upstream_id))

    def upstream_body(self, ctx: RequestContext, hop: Hop) -> dict[str, object]:
        body = with_salt(ctx.body, request_salt(ctx, hop.model))  # whose prefix cache it may use: its pool's scope
        if hop.instance.cfg.engine:  # the engine schedules by the priority admission decided, never the client's
            body["priority"] = ctx.priority
            if self.takes_kv(ctx, hop):
                body["kv_transfer_params"] = ctx.kv_transfer_params  # where the prefill member keeps the prompt's KV
        return body

    async def call(self, ctx: RequestContext, hop: Hop) -> Response:
        _, total = deadlines.limits(self.config, ctx)
        ctx.incomplete = hop.instance.cfg.engine
        body = self.upstream_body(ctx, hop)
        try:
            obj, raw = await relay.call_json(
                self.client,
                hop,
                KIND_PATHS[ctx.kind],
                body,
                ctx.upstream_id,
                ctx.deadline_base + total,
                ctx.trace.hop_traceparent if ctx.trace is not None else None,
            )
        except TimeoutError:
            ctx.outcome.decide("timeout", "total_timeout", 504)
            ctx.instance_ok = not deadlines.instance_too_slow(self.config, ctx, "total")
            raise APIError(504, f"The upstream did not answer within {total:g}s.", "timeout") from None
        finally:
            ctx.upstream_end = time.perf_counter()
        ctx.incomplete = False
        assert ctx.dispatched_at is not None  # dispatch set it for this hop
        ctx.ttft_s = ctx.upstream_end - ctx.dispatched_at + (ctx.prefill_s or 0.0)
        ctx.usage = obj.get("usage")
        if isinstance(transfer := obj.get("kv_transfer_params"), dict) and ctx.prefill_instance is not None:
            ctx.kv_transfer = transfer
        if not ctx.usage:
            ctx.usage, ctx.usage_source = self.estimated_usage(ctx, obj), "estimate_text"
        choices = obj.get("choices") or [{}]
        ctx.finish_reason = choices[0].get("finish_reason")
        return Response(raw, 200, headers=_rate_headers(ctx), media_type="application/json")

    def estimated_usage(self, ctx: RequestContext, answer: dict[str, object]) -> dict[str, object]:
        """An upstream that reported no usage: the prompt as admission counted it, the output as the text of every
        choice counts (the same documented estimate as a stream cut off before its usage)."""
        text = generated_text(answer)
        completion = self.settler.counter(ctx.model).count_text(text) if text else 0
        return {"prompt_tokens": ctx.prompt_tokens, "completion_tokens": completion}

    async def open_stream(self, ctx: RequestContext, hop: Hop, end: RequestEnd) -> Response:
        loop = asyncio.get_running_loop()
        ttft, total = deadlines.limits(self.config, ctx)
        first_deadline = deadlines.first_token_deadline(self.config, ctx)  # what earlier hops left of the budget
        ctx.incomplete = hop.instance.cfg.engine
        per_choice = ctx.max_tokens // max(ctx.choices, 1) if ctx.max_tokens else None  # what each was sent
        chunks = ChunkFilter(
            ctx.client_usage,
            ctx.client_continuous,
            not hop.instance.cfg.engine,
            time.perf_counter,
            per_choice,
            ctx.choices,
        )
        first: list[bytes] = []
        try:
            sse = await relay.open_stream(
                self.client,
                hop,
                KIND_PATHS[ctx.kind],
                self.upstream_body(ctx, hop),
                ctx.upstream_id,
                first_deadline,
                ctx.trace.hop_traceparent if ctx.trace is not None else None,
            )
            stream = end.stream = relay.HopStream(sse, chunks)  # from now on whoever ends the request closes it
            while chunks.first_token_at is None and not chunks.done:
                data = await sse.next(first_deadline)
                if data is None:
                    raise relay.failed(hop, "the stream ended before its first event")
                out = chunks.process(data)
                if chunks.error is not None:
                    why = chunks.error.get("message")
                    raise relay.request_fault(hop, chunks.error) or relay.failed(hop, "an error event", why)
                if out is not None:
                    first.append(out)
        except TimeoutError:
            first_token = loop.time() < ctx.deadline_base + total
            ctx.outcome.decide("timeout", "ttft_timeout" if first_token else "total_timeout", 504)
            which, limit = ("first token", ttft) if first_token else ("response", total)
            ctx.instance_ok = not deadlines.instance_too_slow(self.config, ctx, "ttft" if first_token else "total")
            raise APIError(504, f"The upstream did not send a {which} within {limit:g}s.", "timeout") from None
        except HTTPError as e:  # (an oversized event's bound is not the tenant's to know)
            raise relay.failed(
                hop, "an oversized event" if isinstance(e, EventTooLarge) else "connection failed", e
            ) from e
        assert ctx.dispatched_at is not None  # dispatch set it for this hop
        ctx.ttft_s = (chunks.first_token_at or time.perf_counter()) - ctx.dispatched_at + (ctx.prefill_s or 0.0)
        deadline = ctx.deadline_base + total

        async def pump(send: Send) -> bool:
            return await self.pump(ctx, stream, first, deadline, send)

        return relay.StreamResponse(pump, end.hand_to_body(), _rate_headers(ctx))

    async def pump(
        self, ctx: RequestContext, stream: relay.HopStream, first: list[bytes], deadline: float, send: Send
    ) -> bool:
        """Relay the rest of the stream. False if the client went away (a send failed)."""
        chunks, sse = stream.chunks, stream.sse
        assert sse is not None and ctx.hop is not None  # open_stream opened it for this hop
        tail = b""
        if ctx.trace is not None:  # a client gone mid-stream: the request's end ends the phase
            ctx.trace.phase("relay")
        try:
            await send({"type": "http.response.body", "body": b"".join(first), "more_body": True})
            pending: list[bytes] = []  # events that arrived together leave together: one write, not several
            try:
                async with asyncio.timeout_at(deadline):  # one timer for the whole stream, not one per chunk
                    while not chunks.done and not chunks.cut_off:
                        data = await sse.next()
                        if data is None:
                            break
                        out = chunks.process(data)
                        if out is not None:
                            pending.append(out)
                        if pending and not sse.buffered and not chunks.done and not chunks.cut_off:
                            await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
                            pending.clear()
            except TimeoutError:
                ctx.outcome.decide("timeout", "total_timeout", 504)
                ctx.incomplete = True
                tail = relay.sse_error("The response timed out upstream.", "timeout", "timeout_error")
            except HTTPError as e:  # the upstream connection broke mid-body
                ctx.hop.error = f"{ctx.hop.where}: {e}"
            if chunks.error is not None:  # an error event after the first token: the answer broke off there
                ctx.outcome.decide("error", "upstream_broken", 502)
            if chunks.cut_off and not ctx.outcome.decided:
                pending.append(await self.cut_at_reservation(ctx, stream))
            if chunks.done:
                ctx.incomplete = False
            elif ctx.outcome.status != "timeout":
                ctx.outcome.decide("error", "upstream_broken", 502)
                ctx.incomplete, ctx.instance_ok = True, False
                tail = relay.sse_error(
                    f"The upstream stream broke off ({ctx.hop.public_label}); the response is incomplete.",
                    "upstream_broken",
                    "upstream_error",
                )
            ctx.upstream_end = time.perf_counter()
            await send({"type": "http.response.body", "body": b"".join(pending) + tail, "more_body": False})
            if ctx.trace is not None:
                ctx.trace.end_phase()
            return True
        except OSError:
            return False

    async def cut_at_reservation(self, ctx: RequestContext, stream: relay.HopStream) -> bytes:
        """The upstream went past the max_tokens it was sent (the reservation): read nothing more of it, close its
        stream and stop an engine (whose answer is the exact count made). The bill is the upstream's own usage if
        any came, else what was relayed, counted as a stream without usage is (each delta at least one token); the
        client gets the same usage, if it asked for it, then [DONE]. Returns those last events."""
        chunks, hop = stream.chunks, ctx.hop
        ctx.outcome.note_ok("output_cut")
        ctx.finish_reason = "length"
        assert hop is not None  # a stream of this hop is being relayed
        await stream.close(drain=False)
        if hop.instance.cfg.engine:  # still `incomplete`: a client gone during the abort gets one from finish
            answer = await relay.abort(self.client, hop, ctx.upstream_id)
            ctx.incomplete = False
            if answer and answer.get("usage"):
                ctx.usage, ctx.usage_source = answer["usage"], "engine_abort"
        if not ctx.usage and chunks.usage:
            ctx.usage, ctx.usage_source = chunks.usage, "upstream"
        if not ctx.usage:
            text = "".join(chunks.text)
            counted = self.settler.counter(ctx.model).count_text(text) if text else 0
            completion = max(counted, sum(chunks.relayed.values()))
            total = ctx.prompt_tokens + completion
            ctx.usage = {"prompt_tokens": ctx.prompt_tokens, "completion_tokens": completion, "total_tokens": total}
            ctx.usage_source = "estimate_text"
        return chunks.ending(ctx.usage if ctx.client_usage else None)


def _rate_headers(ctx: RequestContext) -> dict[str, str]:
    """x-ratelimit-* as of the reservation, on successful responses too (as OpenAI sends them)."""
    return dict(getattr(ctx.reservation, "headers", None) or {})
