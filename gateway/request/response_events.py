"""A /v1/responses stream passed through from an upstream that serves it (a pool with `serves_responses`):
`ResponseEventFilter`, the ChunkFilter of such a stream, forwards its events as they came and watches them for what
settle bills, as ChunkFilter does a chat's chunks.
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenweir.gateway.openai.responses_output import chat_usage
from tokenweir.gateway.request.stream_chunks import ChunkFilter

_DELTAS = frozenset({"response.output_text.delta", "response.refusal.delta", "response.function_call_arguments.delta"})
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponseEventFilter(ChunkFilter):
    """Each event forwarded with its `event:` line written back; the token clock and the text from the output deltas;
    usage and finish from the terminal event (response.completed, .incomplete or .failed), which ends the stream (a
    failed one as an error, as an `error` event is). Nothing is cut: the upstream was sent max_output_tokens as
    reserved, and a Responses stream has no choice to end in its place."""

    def process(self, data: bytes) -> bytes | None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return b"data: " + data + b"\n\n"  # not ours to judge; pass it on
        kind = event.get("type") if isinstance(event, dict) else None
        if not isinstance(kind, str):
            return b"data: " + data + b"\n\n"
        if kind in _DELTAS and isinstance(delta := event.get("delta"), str):
            now = self.clock()
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
            if self.keep_text:
                self.text.append(delta)
        elif kind in _TERMINAL:
            response: dict[str, Any] = event["response"] if isinstance(event.get("response"), dict) else {}
            self.usage, self.finish_reason = chat_usage(response)
            if kind == "response.failed":
                self.error = response["error"] if isinstance(response.get("error"), dict) else {}
            self.first_token_at = self.first_token_at or self.clock()  # an answer, even an empty one
            self.done = True
        elif kind == "error":
            self.error = {"message": event.get("message"), "code": event.get("code")}
        return b"event: " + kind.encode()[:128] + b"\ndata: " + data + b"\n\n"
