"""A disaggregated pool's prefill hop: the prompt computed on a prefill member (max_tokens 1, its KV kept there for
the decode member, which fetches it), under the request's TTFT clock, which starts here and goes on running through
the decode hop. Its answer's kv_transfer_params go with the decode hop. A prefill member that fails, refuses or is
late leaves the prompt to the decode member (as a colocated hop). The hop's own token is not the client's: the
engines count it, the bill does not (the event names the prefill member).
"""

from __future__ import annotations

import asyncio
import time

from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.openai.endpoints import KIND_PATHS
from tokenweir.gateway.request.attempt import Attempt
from tokenweir.gateway.request.background import BackgroundTasks
from tokenweir.gateway.request.cache_scope import request_salt, with_salt
from tokenweir.gateway.request.context import RequestContext
from tokenweir.gateway.request.deadlines import Deadlines
from tokenweir.gateway.upstream import calls
from tokenweir.gateway.upstream.client import UpstreamClient
from tokenweir.gateway.upstream.pools import Hop, Upstreams

# what a prefill hop's body leaves out of the request's: it makes one token, for no client
_NOT_FOR_PREFILL = ("max_completion_tokens", "stream_options", "best_of")


def takes_kv(ctx: RequestContext, hop: Hop) -> bool:
    """The hop fetches the prompt's KV the prefill hop left (a decode member of the requested pool)."""
    return ctx.kv_transfer_params is not None and hop.instance.cfg.role == "decode" and not hop.fallback


def fairness_id(ctx: RequestContext, hop: Hop) -> str | None:
    """Whose service the hop is, for our engine's token-fair scheduler: the team, where the hop's pool shares by
    tokens (a pool that shares by requests or first come leaves its engines scheduling as they would without)."""
    return ctx.team_id if ctx.pools[hop.model].cfg.fairness == "tokens" else None


class PrefillHop:
    def __init__(
        self,
        upstreams: Upstreams,
        client: UpstreamClient,
        metrics: Metrics,
        background: BackgroundTasks,
    ) -> None:
        self.upstreams, self.client = upstreams, client
        self.metrics, self.background = metrics, background

    async def run(self, ctx: RequestContext, hashes: list[int], budget: Deadlines) -> None:
        """Try ctx.prefill_hops in order until one keeps the prompt's KV (ctx.prefill_pin), the TTFT budget is spent,
        or one refuses the request (the decode hop then answers the client why)."""
        loop = asyncio.get_running_loop()
        budget.start_ttft_clock()
        deadline = budget.first_token()
        for hop in (h for h in ctx.prefill_hops if not h.instance.removed):  # checked as each goes out
            attempt = Attempt(hop, self.client, fairness_id=fairness_id(ctx, hop))
            hop.instance.take(time.monotonic())
            traceparent = None
            if ctx.trace is not None:
                ctx.trace.start_hop("prefill_hop", hop)
                traceparent = ctx.trace.hop_traceparent
            failed = False
            try:
                answer, _ = await attempt.call(KIND_PATHS[ctx.wire], self.body(ctx, hop), deadline, traceparent)
            except (calls.UpstreamFailed, TimeoutError) as e:
                failed = True
                ctx.upstream_error = f"prefill {hop.where}: {e or 'timed out'}"
                if ctx.trace is not None:
                    ctx.trace.end_hop("failed", str(e) or f"{hop.label}: timed out")
                self.stop(attempt)
                if loop.time() >= deadline:
                    break
                continue
            except calls.UpstreamRejected:
                if ctx.trace is not None:
                    ctx.trace.end_hop("rejected")
                return  # the request itself is refused: the decode hop answers the client why
            except asyncio.CancelledError:  # the client went away (or the server stops): the engine stops too
                self.stop(attempt)
                raise
            finally:
                hop.instance.done(not failed, time.monotonic())
            params = answer.get("kv_transfer_params")
            kept = isinstance(params, dict) and params.get("do_remote_prefill")
            if ctx.trace is not None:
                ctx.trace.end_hop("ok" if kept else "no_kv")
            if kept:
                assert isinstance(params, dict)
                ctx.kv_transfer_params, ctx.prefill_instance, ctx.prefill_pin = params, hop.label, attempt
                ctx.prefill_s = time.perf_counter() - attempt.dispatched_at
                self.metrics.prefill_time.labels(ctx.model, hop.instance.name).observe(ctx.prefill_s)
                self.upstreams.record(hop, hashes)
                return
            break  # a member that keeps no KV (not a kv_producer): the decode member computes the prompt
        self.metrics.prefill_fallbacks.labels(ctx.model).inc()

    def body(self, ctx: RequestContext, hop: Hop) -> dict[str, object]:
        """The request's body for a prefill member: one token, not streamed, its KV kept for a decode member."""
        body = with_salt(ctx.body, request_salt(ctx, hop.model))  # whose prefix cache it may use: its pool's scope
        if hop.instance.cfg.engine:  # the engine schedules by the priority admission decided, never the client's
            body["priority"] = ctx.priority
        for key in _NOT_FOR_PREFILL:
            body.pop(key, None)
        return body | {"max_tokens": 1, "n": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}

    def release(self, ctx: RequestContext) -> None:
        """No decode hop will fetch the prefill hop's KV: its engine lets the blocks go now, not at the pin's
        timeout."""
        assert ctx.prefill_pin is not None
        attempt, ctx.prefill_pin, ctx.kv_transfer_params = ctx.prefill_pin, None, None
        self.stop(attempt)

    def stop(self, attempt: Attempt) -> None:
        """Abort a prefill hop the request no longer waits for, or whose KV nobody will fetch, in the background (it
        must not delay the next hop or a cancellation): its engine stops computing the prompt, or lets its pinned
        blocks go. The prefill hop's tokens are the route's, never billed."""
        if attempt.engine:
            self.background.spawn(attempt.abort())
