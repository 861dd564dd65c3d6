"""What a relayed SSE stream says, chunk by chunk (`ChunkFilter`): usage, finish_reason, the token clock and the
text to count, with what the client did not ask for dropped and each choice held to the bound it was sent; and the
text an answer generated (`choice_text`, `generated_text`), which settle counts when no usage came.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson


class ChunkFilter:
    """Watches a relayed stream's chunks: usage, finish_reason, token clock, text; drops what the client did not
    ask for (usage we requested for ourselves). Chunks without usage are forwarded byte for byte.

    It also holds the upstream to the reservation: every delta that carries text carries at least one token, so a
    choice's content delta beyond `per_choice` (the max_tokens it was sent) proves the upstream ignored that bound
    (a compliant one never gets there). That delta becomes the end of the choice (finish_reason "length") and what
    the upstream sends for it afterwards is dropped; once nothing more can reach the client (`cut_off`), the relay
    stops reading, and `ending` writes the stream's last events itself.

    A stream that reaches [DONE] before any choice came is no answer: an `error` (the hop failed before its first
    byte; the next may serve the request), and that [DONE] is dropped."""

    def __init__(
        self,
        client_usage: bool,
        client_continuous: bool,
        keep_text: bool,
        clock: Callable[[], float],
        per_choice: int | None = None,
        choices: int = 1,
    ) -> None:
        self.client_usage, self.client_continuous = client_usage, client_continuous
        self.keep_text, self.clock = keep_text, clock
        self.usage: dict[str, Any] | None = None
        # a disaggregated decode hop's account of its KV fetch (the usage chunk's)
        self.kv_transfer: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.text: list[str] = []
        self.done = False
        self.error: dict[str, Any] | None = None
        self.per_choice, self.choices = per_choice, max(choices, 1)
        self.relayed: dict[int, int] = {}  # content deltas forwarded, per choice index
        self.ended: set[int] = set()  # choices that have their finish_reason (the upstream's, or "length" of a cut)
        self.cut: set[int] = set()  # choices ended here because the upstream went past their bound
        self.frame: dict[str, Any] = {}  # id, object, created, model of the stream's chunks: for the ones written here
        self._rewritten = False

    def process(self, data: bytes) -> bytes | None:
        """SSE bytes to send to the client for this payload, or None to drop it."""
        if data == b"[DONE]":
            if self.first_token_at is None:
                self.error = {"message": "the stream ended without a choice"}
                return None
            self.done = True
            return b"data: [DONE]\n\n"
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return b"data: " + data + b"\n\n"  # not ours to judge; pass it on
        if not isinstance(obj, dict):
            return b"data: " + data + b"\n\n"
        if "error" in obj and "choices" not in obj:
            self.error = obj.get("error") or {}
            return b"data: " + data + b"\n\n"
        usage = obj.get("usage")
        choices = obj.get("choices") or []
        if usage:
            self.usage = usage
            if isinstance(transfer := obj.get("kv_transfer_params"), dict):
                self.kv_transfer = transfer
        if choices:
            produced, kept = False, []
            for c in choices:
                delta = c.get("delta")
                piece = choice_text(delta) if isinstance(delta, dict) else c.get("text")
                if self.per_choice is not None:
                    c, piece = self._held(obj, c, piece)
                    if c is None:
                        continue
                    kept.append(c)
                if c.get("finish_reason"):
                    self.finish_reason = c["finish_reason"]
                    produced = True
                if piece:
                    produced = True
                    if self.keep_text:  # every choice's (n > 1): what settle counts if no usage comes
                        self.text.append(piece)
            if produced:  # a role-only first chunk is not a token: TTFT waits for content
                now = self.clock()
                if self.first_token_at is None:
                    self.first_token_at = now
                self.last_token_at = now
            if self._rewritten:
                self._rewritten = False
                if not kept:  # only output past a cut: nothing of it is the client's
                    return None
                obj["choices"] = kept
                if usage and not self.client_continuous:
                    del obj["usage"]
                return b"data: " + orjson.dumps(obj) + b"\n\n"
        elif usage:  # the final usage-only chunk
            return b"data: " + data + b"\n\n" if self.client_usage else None
        if usage and not self.client_continuous:
            del obj["usage"]
            return b"data: " + orjson.dumps(obj) + b"\n\n"
        return b"data: " + data + b"\n\n"

    def _held(
        self, obj: dict[str, Any], choice: dict[str, Any], piece: str | None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """One choice of a chunk against its bound: as it came, its end in its place (the first delta past the
        bound), or None (output for a choice already cut)."""
        assert self.per_choice is not None  # process holds choices to a bound only when there is one
        index = choice.get("index", 0)
        if index in self.cut:
            self._rewritten = True
            return None, None
        if piece:
            if self.relayed.get(index, 0) >= self.per_choice:
                self.cut.add(index)
                self.frame = self.frame or {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
                self._rewritten = True
                choice, piece = self._end_of(index, chat="delta" in choice), None
            else:
                self.relayed[index] = self.relayed.get(index, 0) + 1
        if choice.get("finish_reason"):
            self.ended.add(index)
        return choice, piece

    @staticmethod
    def _end_of(index: int, chat: bool) -> dict[str, Any]:
        if chat:
            return {"index": index, "delta": {}, "finish_reason": "length"}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": "length"}

    @property
    def cut_off(self) -> bool:
        """The upstream went past a bound and nothing more of it can reach the client: every choice has ended, or
        every one has relayed all its bound allows."""
        if not self.cut:
            return False
        assert self.per_choice is not None  # a choice is cut only at a bound
        return len(self.ended) >= self.choices or sum(self.relayed.values()) >= self.per_choice * self.choices

    def ending(self, usage: dict[str, Any] | None) -> bytes:
        """The last events of a stream cut at its bound: the end of each choice not yet ended, the usage chunk
        (`usage`, when the client asked for it), then [DONE]."""
        chat = self.frame.get("object") != "text_completion"
        open_choices = [self._end_of(i, chat) for i in range(self.choices) if i not in self.ended]
        out = b"data: " + orjson.dumps({**self.frame, "choices": open_choices}) + b"\n\n" if open_choices else b""
        if usage is not None:
            out += b"data: " + orjson.dumps({**self.frame, "choices": [], "usage": usage}) + b"\n\n"
        self.ended.update(range(self.choices))
        self.done, self.finish_reason = True, "length"
        return out + b"data: [DONE]\n\n"


def choice_text(message: dict[str, Any]) -> str | None:
    """What a chat message or stream delta generated, as text to count: its content and its tool calls' names and
    arguments (a delta carries pieces of them)."""
    content = message.get("content")
    calls = message.get("tool_calls")
    if not calls or not isinstance(calls, list):
        return content if isinstance(content, str) else None
    pieces = [content] if isinstance(content, str) else []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            pieces += [v for v in (function.get("name"), function.get("arguments")) if isinstance(v, str)]
    return "".join(pieces) or None


def generated_text(answer: dict[str, Any]) -> str:
    """The text of every choice of a non-stream answer (chat messages or completion texts), to count when the
    upstream reported no usage."""
    pieces = []
    for c in answer.get("choices") or ():
        if not isinstance(c, dict):
            continue
        message = c.get("message")
        piece = choice_text(message) if isinstance(message, dict) else c.get("text")
        if isinstance(piece, str):
            pieces.append(piece)
    return "".join(pieces)
