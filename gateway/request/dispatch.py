"""Dispatch: the hop loop. Try the route plan's hops in order (the pool's instances as its route strategy ranks them,
then each fallback pool's) until one answers, each as an Attempt (gateway/request/attempt.py); a hop that fails before
the first byte passes to the next and counts against its instance's circuit; with `retries`, the plan again after a
backoff; when every member is full, wait for one. A disaggregated pool's prefill hop goes first
(gateway/request/prefill_hop.py). A stream is opened and relayed by gateway/request/stream_pump.py, a whole answer
called by gateway/request/whole_answer.py; what they made is settled by gateway/request/settle.py through the
request's end (gateway/request/request_end.py), which holds the open stream of a hop and is handed to the stream
response dispatch returns.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

from fastapi.responses import Response

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.config import GatewayConfig
from tokenweir.gateway.openai.prompt_ids import head_tokens, prompt_token_ids
from tokenweir.gateway.openai.token_count import TokenCounter
from tokenweir.gateway.request.attempt import Attempt
from tokenweir.gateway.request.background import BackgroundTasks
from tokenweir.gateway.request.cache_scope import request_salt, with_salt
from tokenweir.gateway.request.context import RequestContext
from tokenweir.gateway.request.deadlines import Deadlines
from tokenweir.gateway.request.prefill_hop import PrefillHop, fairness_id, takes_kv
from tokenweir.gateway.request.request_end import RequestEnd
from tokenweir.gateway.request.settle import Settler
from tokenweir.gateway.request.shadow import ShadowMirror
from tokenweir.gateway.request.stream_pump import StreamPump
from tokenweir.gateway.request.variant_choice import baseline_hops
from tokenweir.gateway.request.whole_answer import WholeAnswer
from tokenweir.gateway.state.member_slots import MemberSlots
from tokenweir.gateway.upstream import calls
from tokenweir.gateway.upstream.client import UpstreamClient
from tokenweir.gateway.upstream.pools import Hop, Upstreams

# try_hop's answer for a hop it did not try: its member serves max_parallel_requests already, or left the table
UNTRIED = "its member is full or gone"


class Dispatcher:
    def __init__(
        self,
        config: GatewayConfig,
        upstreams: Upstreams,
        client: UpstreamClient,
        metrics: Metrics,
        members: MemberSlots,
        background: BackgroundTasks,
        counter: Callable[[str], TokenCounter],
        settler: Settler,
    ) -> None:
        """`members`: the slots under members' max_parallel_requests, across replicas; `background`: what runs on
        for a request (a mirror, a prefill hop's abort); `counter`: a pool's token counts, for an upstream that sends
        no usage; `settler`: what journals an attempt as it goes out and releases one that failed (the request's end
        releases the last)."""
        self.config, self.upstreams, self.client, self.metrics = config, upstreams, client, metrics
        self.members, self.settler = members, settler
        self.shadow = ShadowMirror(config, client, metrics, members, background)
        self.prefill = PrefillHop(upstreams, client, metrics, background)
        self.whole = WholeAnswer(counter)
        self.stream = StreamPump(counter)

    def route(self, ctx: RequestContext) -> tuple[list[Hop], list[int]]:
        """The route plan (its first hop chosen by the pool's strategy), the decision on ctx and in metrics, and the
        prompt's block hashes for the prefix index."""
        target = ctx.context_fallback or ctx.model  # the pool whose context fits the prompt
        pool = ctx.pools[target]
        token_ids, head = None, 0
        if pool.cfg.strategy == "prefix" and ctx.kind != "embeddings":  # an embedding leaves no KV cache behind
            if ctx.prompt_ids is not None and ctx.prompt_ids[0] == pool.cfg.tokenizer:
                token_ids = ctx.prompt_ids[1]  # admission's count made them with this tokenizer: tokenized once
            else:
                token_ids = prompt_token_ids(pool.cfg.tokenizer, ctx.wire, ctx.body)
            if token_ids and ctx.wire == "chat":
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
        assert ctx.sealed, "dispatch takes a request admission has decided"
        hops, hashes = self.route(ctx)
        budget = Deadlines.of(self.config, ctx)
        end.on_settled = self.shadow.sample(ctx)  # a mirror, sent once the request has ended and been billed
        if ctx.prefill_hops:
            await self.prefill.run(ctx, hashes, budget)
            if ctx.stream and asyncio.get_running_loop().time() >= budget.first_token():
                # the prefill hop spent the whole TTFT budget: no decode hop could send a first token in time
                if ctx.prefill_pin is not None:
                    self.prefill.release(ctx)
                ctx.outcome.decide("timeout", "ttft_timeout", 504)
                raise APIError(504, f"The upstream did not send a first token within {budget.ttft_s:g}s.", "timeout")
        last = "every instance's circuit is open"
        for plan_round in range(1 + ctx.pools[ctx.model].cfg.retries):
            if plan_round:  # a retry: the whole plan again, after a backoff
                if not await self.back_off(ctx, plan_round, budget):
                    break
                hops = self.retry_plan(ctx)
                self.metrics.retries.labels(ctx.model).inc()
            waits = 0
            while True:
                tried = False
                for hop in hops:
                    answer = await self.try_hop(ctx, hop, end, hashes, budget)
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
            self.prefill.release(ctx)
        raise APIError(
            503,
            f"No upstream could serve '{ctx.model}' ({last}). Retry shortly.",
            "upstream_unavailable",
            headers={"retry-after": str(max(1, int(self.config.breaker.cooldown_s)))},
        )

    async def try_hop(
        self, ctx: RequestContext, hop: Hop, end: RequestEnd, hashes: list[int], budget: Deadlines
    ) -> Response | str:
        """The hop's answer, or why it failed before its first byte (the next hop, or a retry, may serve it);
        UNTRIED, without trying it, when its member serves max_parallel_requests already or has left the routing table
        (removed since the plan was made: it gets nothing new)."""
        if hop.instance.removed:
            return UNTRIED
        lease = None
        cap = hop.instance.cfg.max_parallel_requests
        if cap is not None:
            lease_id = await self.members.take(hop.instance.cfg.base_url, cap)
            if lease_id is None:
                return UNTRIED
            lease = (hop.instance.cfg.base_url, lease_id)
        if ctx.prefill_pin is not None and not takes_kv(ctx, hop):
            self.prefill.release(ctx)  # a hop that computes the prompt itself: nobody will fetch the KV
        budget.start_ttft_clock()  # the first hop out starts it; a later one spends what is left
        attempt = Attempt(hop, self.client, lease, fairness_id=fairness_id(ctx, hop))
        ctx.start_attempt(attempt)
        if ctx.trace is not None:
            ctx.trace.start_hop("hop", hop)
        self.settler.dispatched(ctx, hop)  # journaled: a worker killed from here on still bills what it made
        hop.instance.take(time.monotonic())
        self.upstreams.record(hop, hashes)
        self.metrics.in_flight.labels(ctx.model).inc()
        body = self.upstream_body(ctx, hop)
        try:
            if ctx.stream:
                return await self.stream.open(ctx, attempt, body, end, budget)
            return await self.whole.call(ctx, attempt, body, budget)
        except calls.UpstreamFailed as e:
            attempt.incomplete = False
            # The request may have reached the engine (a stream that failed before its first token, a connection lost
            # after sending): stop it and keep what it counted, so the bill still matches the engine's counters.
            usage = ((await attempt.abort()) or {}).get("usage") or {}
            ctx.spilled_prompt_tokens += int(usage.get("prompt_tokens") or 0)
            ctx.spilled_completion_tokens += int(usage.get("completion_tokens") or 0)
            if ctx.trace is not None:
                ctx.trace.end_hop("failed", str(e))
            self.settler.release_hop(ctx, ok=False)
            await end.drop_stream()  # its usage, if any, is in `spilled` now
            return str(e)
        except calls.UpstreamRejected as e:
            attempt.incomplete = False
            # Refused before running: nothing was made. An engine may have failed the request part-way (a grammar it
            # could not follow): it counted what it made, and the bill says the same.
            ctx.usage = {"prompt_tokens": 0, "completion_tokens": 0}
            if attempt.engine:
                usage = ((await attempt.abort()) or {}).get("usage") or {}
                ctx.usage = {k: int(usage.get(k) or 0) for k in ("prompt_tokens", "completion_tokens")}
                ctx.usage_source = "engine_abort"
            await end.drop_stream()
            if ctx.trace is not None:
                ctx.trace.end_hop("rejected", f"{hop.label}: HTTP {e.status}")
            ctx.outcome.decide("error", "upstream_rejected", e.status)
            return Response(e.body, e.status, media_type="application/json")

    async def back_off(self, ctx: RequestContext, attempt: int, budget: Deadlines) -> bool:
        """Wait before retry `attempt` (exponential, with jitter: replicas that failed together do not come back
        together); False, without waiting, if the wait would pass the request's deadline (its first token's, for a
        stream: the hops before spent that budget, the retry does not restart it)."""
        pool = ctx.pools[ctx.model].cfg
        delay = pool.retry_backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.0)
        if asyncio.get_running_loop().time() + delay >= budget.answer(ctx.stream):
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

    def upstream_body(self, ctx: RequestContext, hop: Hop) -> dict[str, Any]:
        if ctx.hop_kind(hop.model) == "responses":  # passed through, held to the output it was reserved
            assert ctx.responses_body is not None  # hop_kind says so only then
            source = {**ctx.responses_body, "max_output_tokens": ctx.body["max_tokens"]}
        else:
            source = ctx.body
        body = with_salt(source, request_salt(ctx, hop.model))  # whose prefix cache it may use: its pool's scope
        if hop.instance.cfg.engine:  # the engine schedules by the priority admission decided, never the client's
            body["priority"] = ctx.priority
            if takes_kv(ctx, hop):
                body["kv_transfer_params"] = ctx.kv_transfer_params  # where the prefill member keeps the prompt's KV
        return body
