"""Server-sent events for chat and text completions: one loop turns a request's outputs into `data:` chunks, ends
with `data: [DONE]`, and closes the request stream (so aborts the request) however the response ends.

Shapes follow OpenAI and vLLM: without stream_options a chunk has no `usage` key at all; with include_usage every
chunk has `usage: null` and a last chunk with no choices carries the totals; continuous_usage_stats puts the running
totals on every chunk. An error once the headers are sent becomes an error event, then [DONE].
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from tokenweir.engine.api.errors import to_api_error
from tokenweir.engine.api.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Completion,
    DeltaMessage,
    Usage,
    dump_response,
)
from tokenweir.engine.core.async_engine import RequestStream
from tokenweir.engine.core.output import RequestOutput


class RequestStreamResponse(StreamingResponse):
    """An SSE response that closes its request stream however the response ends: a client gone before the first
    byte never starts the body generator, so the generator's own `finally` cannot be relied on alone."""

    def __init__(self, request_stream: RequestStream, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.request_stream = request_stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.request_stream.close()


def stream_response(
    stream: RequestStream,
    chunk_type: type[ChatCompletionChunk] | type[Completion],
    choice: Callable[[RequestOutput], BaseModel],
    *,
    response_id: str,
    model: str,
    include_usage: bool,
    continuous_usage: bool,
    show_token_ids: bool,
    first_choices: list[ChatChunkChoice] | None = None,
) -> RequestStreamResponse:
    """`choice` renders one output as a chunk's choice; `first_choices`, if given, open the stream (chat announces
    the assistant's role in each choice before any token)."""
    created = int(time.time())
    drop_usage = not (include_usage or continuous_usage)

    def event(choices: list[Any], usage: Usage | None, extra: dict | None = None) -> str:
        """One chunk: `choices` of chunk_type's own choice type (the caller pairs them), `extra` top-level keys."""
        chunk = chunk_type(id=response_id, created=created, model=model, choices=choices, usage=usage)
        data = dump_response(chunk) | (extra or {})
        if drop_usage:
            del data["usage"]
        for delta in (c["delta"] for c in data["choices"] if "delta" in c):
            for key in [k for k, v in delta.items() if v is None]:  # OpenAI sends the role once, in the first delta
                del delta[key]
        return sse(data)

    async def events() -> AsyncIterator[str]:
        try:
            n = stream.num_prompt_tokens
            no_tokens_yet = Usage(prompt_tokens=n, completion_tokens=0, total_tokens=n)
            for first in first_choices or []:
                yield event([first], no_tokens_yet if continuous_usage else None)
            async for out in stream:
                if not (out.new_text or out.finish_reason or out.logprobs or show_token_ids):
                    continue  # a token whose text is held back (partial UTF-8 or a possible stop string)
                rendered = choice(out)
                if (
                    isinstance(rendered, ChatChunkChoice)
                    and rendered.delta == DeltaMessage()
                    and not (rendered.finish_reason or rendered.logprobs or show_token_ids)
                ):
                    continue  # nothing to show yet (a tool-call list shown once it is complete)
                yield event([rendered], Usage.model_validate(out.usage) if continuous_usage else None)
            if include_usage:
                assert stream.final is not None  # the stream ended without raising: on its finished output
                # a disaggregated hop's kv_transfer_params ride on it, as on a whole response
                transfer = stream.final.kv_transfer_params
                yield event([], Usage.model_validate(stream.final.usage), transfer and {"kv_transfer_params": transfer})
        except Exception as exc:  # the headers are gone: say it in the stream, as vLLM does
            yield sse(to_api_error(exc).body())
        finally:
            stream.close()
        yield "data: [DONE]\n\n"

    return RequestStreamResponse(stream, events())


def sse(data: dict) -> str:
    return "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n\n"
