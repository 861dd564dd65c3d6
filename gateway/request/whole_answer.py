"""A hop answered whole (not streamed): one call under the request's total deadline, its usage billed (or, where the
upstream sent none, estimated from the text), its answer passed through as the upstream wrote it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi.responses import Response

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.openai.endpoints import KIND_PATHS
from tokenweir.gateway.openai.responses_output import chat_usage
from tokenweir.gateway.openai.token_count import TokenCounter
from tokenweir.gateway.request.attempt import Attempt
from tokenweir.gateway.request.context import RequestContext
from tokenweir.gateway.request.deadlines import Deadlines
from tokenweir.gateway.request.stream_chunks import generated_text


class WholeAnswer:
    def __init__(self, counter: Callable[[str], TokenCounter]) -> None:
        self.counter = counter  # a pool's token counts, for an upstream that sends no usage

    async def call(self, ctx: RequestContext, attempt: Attempt, body: dict[str, Any], budget: Deadlines) -> Response:
        attempt.incomplete = attempt.engine
        traceparent = ctx.trace.hop_traceparent if ctx.trace is not None else None
        kind = ctx.hop_kind(attempt.hop.model)
        try:
            obj, raw = await attempt.call(KIND_PATHS[kind], body, budget.total, traceparent)
        except TimeoutError:
            ctx.outcome.decide("timeout", "total_timeout", 504)
            attempt.instance_ok = not budget.total_blames_instance
            raise APIError(504, f"The upstream did not answer within {budget.total_s:g}s.", "timeout") from None
        finally:
            ctx.upstream_end = time.perf_counter()
        attempt.incomplete = False
        ctx.ttft_s = ctx.upstream_end - attempt.dispatched_at + (ctx.prefill_s or 0.0)
        ctx.usage = obj.get("usage")
        if kind == "responses":  # passed through to a pool that serves /v1/responses: its usage is a response's
            ctx.usage, ctx.finish_reason = chat_usage(obj)
            return Response(raw, 200, headers=ctx.rate_headers(), media_type="application/json")
        if isinstance(transfer := obj.get("kv_transfer_params"), dict) and ctx.prefill_instance is not None:
            ctx.kv_transfer = transfer
        if not ctx.usage:
            ctx.usage, ctx.usage_source = self.estimated_usage(ctx, obj), "estimate_text"
        choices = obj.get("choices") or [{}]
        ctx.finish_reason = choices[0].get("finish_reason")
        return Response(raw, 200, headers=ctx.rate_headers(), media_type="application/json")

    def estimated_usage(self, ctx: RequestContext, answer: dict[str, Any]) -> dict[str, Any]:
        """An upstream that reported no usage: the prompt as admission counted it, the output as the text of every
        choice counts (the same documented estimate as a stream cut off before its usage)."""
        text = generated_text(answer)
        completion = self.counter(ctx.model).count_text(text) if text else 0
        return {"prompt_tokens": ctx.prompt_tokens, "completion_tokens": completion}
