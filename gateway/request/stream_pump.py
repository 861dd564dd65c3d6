"""A hop's stream relayed to the client: opened and read up to its first token under the TTFT deadline (a hop that
fails before it lets dispatch try the next), then pumped chunk by chunk under the total deadline by the stream
response's body (gateway/request/relay.py StreamResponse), which ends the request when it is over.

What the chunks say (usage, text, the token clock) is kept by their ChunkFilter on the hop's stream, which the
request's end closes and bills from. An upstream that goes past the max_tokens it was sent is cut there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi.responses import Response
from starlette.types import Send

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.openai.endpoints import KIND_PATHS
from tokenweir.gateway.openai.token_count import TokenCounter
from tokenweir.gateway.request import relay
from tokenweir.gateway.request.attempt import Attempt
from tokenweir.gateway.request.context import RequestContext
from tokenweir.gateway.request.deadlines import Deadlines
from tokenweir.gateway.request.request_end import RequestEnd
from tokenweir.gateway.request.response_events import ResponseEventFilter
from tokenweir.gateway.request.stream_chunks import ChunkFilter
from tokenweir.gateway.upstream import calls
from tokenweir.gateway.upstream.client import HTTPError
from tokenweir.gateway.upstream.sse import EventTooLarge


class StreamPump:
    def __init__(self, counter: Callable[[str], TokenCounter]) -> None:
        self.counter = counter  # a pool's token counts, for an upstream that sends no usage

    async def open(
        self, ctx: RequestContext, attempt: Attempt, body: dict[str, Any], end: RequestEnd, budget: Deadlines
    ) -> Response:
        """The stream's response, once its first token came; the stream itself is the request's end's from the
        moment it opened (whoever ends the request closes it)."""
        loop = asyncio.get_running_loop()
        first_deadline = budget.first_token()  # what earlier hops left of the budget
        hop = attempt.hop
        attempt.incomplete = attempt.engine
        per_choice = ctx.max_tokens // max(ctx.choices, 1) if ctx.max_tokens else None  # what each was sent
        kind = ctx.hop_kind(hop.model)
        if kind == "responses":  # passed through to a pool that serves /v1/responses: its events, as they come
            chunks: ChunkFilter = ResponseEventFilter(False, False, True, time.perf_counter)
        else:
            chunks = ChunkFilter(
                ctx.client_usage, ctx.client_continuous, not attempt.engine, time.perf_counter, per_choice, ctx.choices
            )
        first: list[bytes] = []
        traceparent = ctx.trace.hop_traceparent if ctx.trace is not None else None
        try:
            sse = await attempt.open(KIND_PATHS[kind], body, first_deadline, traceparent)
            stream = end.stream = relay.HopStream(sse, chunks)  # from now on whoever ends the request closes it
            while chunks.first_token_at is None and not chunks.done:
                data = await sse.next(first_deadline)
                if data is None:
                    raise calls.failed(hop, "the stream ended before its first event")
                out = chunks.process(data)
                if chunks.error is not None:
                    why = chunks.error.get("message")
                    raise calls.request_fault(hop, chunks.error) or calls.failed(hop, "an error event", why)
                if out is not None:
                    first.append(out)
        except TimeoutError:
            first_token = loop.time() < budget.total
            ctx.outcome.decide("timeout", "ttft_timeout" if first_token else "total_timeout", 504)
            which, limit = ("first token", budget.ttft_s) if first_token else ("response", budget.total_s)
            blamed = budget.ttft_blames_instance if first_token else budget.total_blames_instance
            attempt.instance_ok = not blamed
            raise APIError(504, f"The upstream did not send a {which} within {limit:g}s.", "timeout") from None
        except HTTPError as e:  # (an oversized event's bound is not the tenant's to know)
            reason = "an oversized event" if isinstance(e, EventTooLarge) else "connection failed"
            raise calls.failed(hop, reason, e) from e
        ctx.ttft_s = (chunks.first_token_at or time.perf_counter()) - attempt.dispatched_at + (ctx.prefill_s or 0.0)
        deadline = budget.total

        async def pump(send: Send) -> bool:
            return await self.pump(ctx, attempt, stream, first, deadline, send)

        return relay.StreamResponse(pump, end.hand_to_body(), ctx.rate_headers())

    async def pump(
        self,
        ctx: RequestContext,
        attempt: Attempt,
        stream: relay.HopStream,
        first: list[bytes],
        deadline: float,
        send: Send,
    ) -> bool:
        """Relay the rest of the stream. False if the client went away (a send failed)."""
        if ctx.trace is not None:  # a client gone mid-stream: the request's end ends the phase
            ctx.trace.phase("relay")
        try:
            await send({"type": "http.response.body", "body": b"".join(first), "more_body": True})
            pending: list[bytes] = []  # events that arrived together leave together: one write, not several
            tail = await self.relay_until_the_end(ctx, attempt, stream, pending, deadline, send)
            tail = await self.how_it_ended(ctx, attempt, stream, pending) or tail
            ctx.upstream_end = time.perf_counter()
            await send({"type": "http.response.body", "body": b"".join(pending) + tail, "more_body": False})
            if ctx.trace is not None:
                ctx.trace.end_phase()
            return True
        except OSError:
            return False

    async def relay_until_the_end(
        self,
        ctx: RequestContext,
        attempt: Attempt,
        stream: relay.HopStream,
        pending: list[bytes],
        deadline: float,
        send: Send,
    ) -> bytes:
        """Events to the client as they come, until [DONE], the reservation's end, the stream's end or break, or the
        deadline; what is not sent yet stays in `pending`. Returns the timeout's error event, if it fired."""
        chunks, sse = stream.chunks, stream.sse
        assert sse is not None  # open() opened it
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
            attempt.incomplete = True
            return relay.sse_error("The response timed out upstream.", "timeout", "timeout_error")
        except HTTPError as e:  # the upstream connection broke mid-body
            attempt.hop.error = f"{attempt.hop.where}: {e}"
        return b""

    async def how_it_ended(
        self, ctx: RequestContext, attempt: Attempt, stream: relay.HopStream, pending: list[bytes]
    ) -> bytes:
        """The outcome of a stream that stopped being relayed: whole, cut at the reservation (its last events go to
        `pending`), or broken off (returns the error event that ends it for the client)."""
        chunks = stream.chunks
        if chunks.error is not None:  # an error event after the first token: the answer broke off there
            ctx.outcome.decide("error", "upstream_broken", 502)
        if chunks.cut_off and not ctx.outcome.decided:
            pending.append(await self.cut_at_reservation(ctx, attempt, stream))
        if chunks.done:
            attempt.incomplete = False
        elif ctx.outcome.status != "timeout":
            ctx.outcome.decide("error", "upstream_broken", 502)
            attempt.incomplete, attempt.instance_ok = True, False
            return relay.sse_error(
                f"The upstream stream broke off ({attempt.hop.public_label}); the response is incomplete.",
                "upstream_broken",
                "upstream_error",
            )
        return b""

    async def cut_at_reservation(self, ctx: RequestContext, attempt: Attempt, stream: relay.HopStream) -> bytes:
        """The upstream went past the max_tokens it was sent (the reservation): read nothing more of it, close its
        stream and stop an engine (whose answer is the exact count made). The bill is the upstream's own usage if
        any came, else what was relayed, counted as a stream without usage is (each delta at least one token); the
        client gets the same usage, if it asked for it, then [DONE]. Returns those last events."""
        chunks = stream.chunks
        ctx.outcome.note_ok("output_cut")
        ctx.finish_reason = "length"
        await stream.close(drain=False)
        if attempt.engine:  # still `incomplete`: a client gone during the abort gets one from the request's end
            answer = await attempt.abort()
            attempt.incomplete = False
            if answer and answer.get("usage"):
                ctx.usage, ctx.usage_source = answer["usage"], "engine_abort"
        if not ctx.usage and chunks.usage:
            ctx.usage, ctx.usage_source = chunks.usage, "upstream"
        if not ctx.usage:
            text = "".join(chunks.text)
            counted = self.counter(ctx.model).count_text(text) if text else 0
            completion = max(counted, sum(chunks.relayed.values()))
            total = ctx.prompt_tokens + completion
            ctx.usage = {"prompt_tokens": ctx.prompt_tokens, "completion_tokens": completion, "total_tokens": total}
            ctx.usage_source = "estimate_text"
        return chunks.ending(ctx.usage if ctx.client_usage else None)
