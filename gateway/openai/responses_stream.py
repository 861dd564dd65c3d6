"""A chat stream as the Responses API's server-sent events (`ResponseEvents`, pure: SSE bytes in, SSE bytes out).

The pipeline relays the upstream's chat chunks as for any chat (gateway/request/stream_pump.py); this rewrites each
write before it leaves, in OpenAI's order, every event numbered by `sequence_number`:

    response.created, response.in_progress,
    for the text: response.output_item.added, response.content_part.added, response.output_text.delta...,
                  response.output_text.done, response.content_part.done, response.output_item.done,
    for each function call: response.output_item.added, response.function_call_arguments.delta...,
                  response.function_call_arguments.done, response.output_item.done,
    response.completed (response.incomplete when the chat ended by length; response.failed when it broke off).

The last event carries the whole response (`final`), which is also what a stored response keeps. A stream that
already is Responses events (passed through from a pool that serves /v1/responses) goes on as it came, its response
made this gateway's (`passed_through`: its id, the fields it echoes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from tokenweir.gateway.openai import responses_output as out


class _Call:
    """A function call being streamed: chat's tool call `index` -> its item."""

    __slots__ = ("arguments", "call_id", "item_id", "name", "output_index")

    def __init__(self, item_id: str, call_id: str, name: str, output_index: int) -> None:
        self.item_id, self.call_id, self.name, self.output_index = item_id, call_id, name, output_index
        self.arguments = ""


class ResponseEvents:
    def __init__(self, envelope: dict[str, Any], new_id: Callable[[str], str]) -> None:
        self.envelope, self.new_id = envelope, new_id
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items done, in output order
        self.next_index = 0  # the output_index of the next item opened
        self.text: str | None = None  # the open message's text (None: no message open)
        self.text_id, self.text_index = "", 0
        self.calls: dict[int, _Call] = {}  # open function calls by chat's tool call index
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.final: dict[str, Any] | None = None  # the whole response, once the stream ended
        self.started = False  # response.created and .in_progress sent
        self.passthrough = False  # the upstream's own Responses events, passed on

    # --- the stream's writes ----------------------------------------------------------------------------------

    def start(self) -> bytes:
        """The stream's first events (once; nothing for a stream passed through, which has its own)."""
        if self.started or self.passthrough:
            return b""
        self.started, created = True, self.envelope
        return self.event("response.created", response=created) + self.event("response.in_progress", response=created)

    def feed(self, data: bytes) -> bytes:
        """What the client gets for one write of the chat stream (whole `data: ...` frames, as the relay writes)."""
        events = b""
        for frame in data.split(b"\n\n"):
            payload = next((line[5:].strip() for line in frame.split(b"\n") if line.startswith(b"data:")), b"")
            if not payload or payload == b"[DONE]":
                continue
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue  # not a chunk (a comment, a keep-alive): nothing of the response
            if isinstance(chunk, dict) and isinstance(chunk.get("type"), str) and not self.started:
                events += self.passed_on(chunk)
            elif isinstance(chunk, dict):
                events += self.start() + self.chunk(chunk)
        return events

    def passed_on(self, event: dict[str, Any]) -> bytes:
        """An event of a stream passed through: its response made this gateway's; a terminal one's is the final."""
        self.passthrough = True
        if isinstance(event.get("response"), dict):
            event["response"] = out.passed_through(event["response"], self.envelope)
            if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                self.final = event["response"]
        seq = event.get("sequence_number")
        self.sequence = max(self.sequence, seq + 1) if isinstance(seq, int) else self.sequence
        return b"event: " + event["type"].encode()[:128] + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    def end(self) -> bytes:
        """The stream is over: its open items closed, then the response's last event (a stream passed through has
        its own, unless it broke off)."""
        if self.passthrough and self.final is not None and self.error is None:
            return b""
        events = self.start() + self.close_text() + self.close_calls()
        if self.error is not None or self.passthrough:
            self.error = self.error or {"code": "upstream_broken", "message": "The upstream stream broke off."}
            response = self.envelope | {"status": "failed", "error": self.error, "output": self.output}
            response["usage"] = out.response_usage(self.usage)
            self.final = response
            return events + self.event("response.failed", response=response)
        self.final = out.finished(self.envelope, self.output, self.finish_reason, self.usage)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return events + self.event(kind, response=self.final)

    # --- one chunk -------------------------------------------------------------------------------------------

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        if isinstance(chunk.get("error"), dict) and "choices" not in chunk:
            err = chunk["error"]
            self.error = {"code": str(err.get("code") or "server_error"), "message": str(err.get("message") or "")}
            return b""
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        events = b""
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # a response has one choice
            delta: dict[str, Any] = choice["delta"] if isinstance(choice.get("delta"), dict) else {}
            text = delta.get("content")
            if isinstance(text, str) and text:
                events += self.text_delta(text)
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    events += self.call_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def text_delta(self, text: str) -> bytes:
        events = b""
        if self.text is None:
            self.text, self.text_id, self.text_index = "", self.new_id("msg"), self.take_index()
            item = out.message_item(self.text_id, "", "in_progress")
            item["content"] = []
            events += self.event("response.output_item.added", output_index=self.text_index, item=item)
            events += self.event("response.content_part.added", **self.at_text(), part=_text_part(""))
        self.text += text
        return events + self.event("response.output_text.delta", **self.at_text(), delta=text, logprobs=[])

    def call_delta(self, call: dict[str, Any]) -> bytes:
        index = call.get("index", 0)
        function: dict[str, Any] = call["function"] if isinstance(call.get("function"), dict) else {}
        events = b""
        current = self.calls.get(index)
        if current is None:
            events += self.close_text()  # a turn's text comes before its calls
            call_id = call["id"] if isinstance(call.get("id"), str) else self.new_id("call")
            current = _Call(self.new_id("fc"), call_id, str(function.get("name") or ""), self.take_index())
            self.calls[index] = current
            item = out.function_call_item(current.item_id, current.call_id, current.name, "", "in_progress")
            events += self.event("response.output_item.added", output_index=current.output_index, item=item)
        piece = function.get("arguments")
        if isinstance(piece, str) and piece:
            current.arguments += piece
            at = {"item_id": current.item_id, "output_index": current.output_index}
            events += self.event("response.function_call_arguments.delta", **at, delta=piece)
        return events

    # --- closing items ---------------------------------------------------------------------------------------

    def close_text(self) -> bytes:
        if self.text is None:
            return b""
        text, self.text = self.text, None
        status = self.item_status()
        item = out.message_item(self.text_id, text, status)
        events = self.event("response.output_text.done", **self.at_text(), text=text, logprobs=[])
        events += self.event("response.content_part.done", **self.at_text(), part=_text_part(text))
        events += self.event("response.output_item.done", output_index=self.text_index, item=item)
        self.output.append(item)
        return events

    def close_calls(self) -> bytes:
        events = b""
        for call in sorted(self.calls.values(), key=lambda c: c.output_index):
            at = {"item_id": call.item_id, "output_index": call.output_index}
            events += self.event("response.function_call_arguments.done", **at, arguments=call.arguments)
            item = out.function_call_item(call.item_id, call.call_id, call.name, call.arguments, self.item_status())
            events += self.event("response.output_item.done", output_index=call.output_index, item=item)
            self.output.append(item)
        self.calls.clear()
        return events

    def item_status(self) -> str:
        return "incomplete" if self.finish_reason == "length" or self.error is not None else "completed"

    def take_index(self) -> int:
        index, self.next_index = self.next_index, self.next_index + 1
        return index

    def at_text(self) -> dict[str, Any]:
        return {"item_id": self.text_id, "output_index": self.text_index, "content_index": 0}

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
