"""How a choice's outputs read in each API shape: text or tool calls, and logprobs in chat's or completions' format.

One renderer per response, as it may keep per-choice state while a stream goes (a tool call's id, the text offset of
completions' logprobs, the echoed prompt sent once).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from tokenweir.common.text.tokenizer import Tokenizer
from tokenweir.engine.api.chosen_calls import ChosenCalls, tool_call_id
from tokenweir.engine.api.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from tokenweir.engine.api.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    TokenLogprobEntry,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
)
from tokenweir.engine.core.output import RequestOutput
from tokenweir.engine.sched.sequence import TokenLogprob
from tokenweir.engine.tool_parsers import ToolParser


class TokenText:
    """Token ids as the logprobs formats show them: each token's own text, and its bytes (a token may hold part of
    a UTF-8 character, whose text alone is a replacement character)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else str(token_id).encode()

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def top(self, token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=self.text(token_id), logprob=logprob, bytes=list(self.bytes(token_id)))


class ChatRenderer:
    def __init__(
        self, body: ChatCompletionRequest, tokenizer: Tokenizer | None, tool_parser: ToolParser | None = None
    ) -> None:
        self.tool_mode = body.tool_mode
        # Calls the model chooses: read by the parser (the route refused "auto" without one)
        self.chosen = ChosenCalls(tool_parser) if self.tool_mode == "auto" and tool_parser is not None else None
        self.function: str | None = None
        if self.tool_mode == "named":
            assert isinstance(body.tool_choice, NamedToolChoice)  # what the "named" tool mode means
            self.function = body.tool_choice.function.name
        self.tokens = TokenText(tokenizer)
        self.show_token_ids = body.return_token_ids
        self._call_ids: dict[int, str] = {}  # streamed named calls: choice index -> its call id
        self._buffers: dict[int, str] = {}  # streamed "required" calls: the text so far, parsed at the end

    def logprobs(self, entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if entries is None:
            return None
        return ChatLogprobs(
            content=[
                TokenLogprobEntry(
                    **self.tokens.top(e.token_id, e.logprob).model_dump(),
                    top_logprobs=[self.tokens.top(t, lp) for t, lp in e.top],
                )
                for e in entries
            ]
        )

    def finish_reason(self, out: RequestOutput, called: bool) -> str | None:
        # A forced named call ends "stop", as OpenAI's and vLLM's do; calls from "required" or chosen ones end
        # "tool_calls".
        if self.tool_mode in ("required", "auto") and called and out.finish_reason == "stop":
            return "tool_calls"
        return out.finish_reason

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        """The tool calls an output's text holds, or None where it is not complete JSON (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.tool_mode == "named":
            assert self.function is not None  # set with the "named" tool mode
            return [ToolCall(id=tool_call_id(), function=FunctionCall(name=self.function, arguments=text))]
        return [
            ToolCall(id=tool_call_id(), function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"])))
            for c in value
        ]

    def choice(self, out: RequestOutput) -> ChatChoice:
        if self.chosen is not None:
            message, called = self.chosen.message(out.new_text)
            return ChatChoice(message=message, **self._choice_fields(out, called))
        calls = self.parse_calls(out.new_text) if self.tool_mode else None
        message = AssistantMessage(content=None, tool_calls=calls) if calls else AssistantMessage(content=out.new_text)
        return ChatChoice(message=message, **self._choice_fields(out, bool(calls)))

    def chunk_choice(self, out: RequestOutput) -> ChatChunkChoice:
        delta, called = self._delta(out)
        return ChatChunkChoice(delta=delta, **self._choice_fields(out, called))

    def _choice_fields(self, out: RequestOutput, called: bool) -> dict:
        """What a choice says besides its text, the same whether it comes whole or as a stream chunk."""
        return {
            "index": out.index,
            "logprobs": self.logprobs(out.logprobs),
            "finish_reason": self.finish_reason(out, called),
            "stop_reason": out.stop_reason,
            "token_ids": out.new_token_ids if self.show_token_ids else None,
        }

    def _delta(self, out: RequestOutput) -> tuple[DeltaMessage, bool]:
        """The chunk's delta, and whether the choice has made calls (its finish reason then says tool_calls)."""
        if self.chosen is not None:
            return self.chosen.delta(out.index, out.new_text, out.finish_reason is not None)
        if self.tool_mode == "named":  # the arguments stream as they come, as vLLM streams a named call
            if not out.new_text:
                return DeltaMessage(), False
            first = out.index not in self._call_ids
            call_id = self._call_ids.setdefault(out.index, tool_call_id())
            function = FunctionCallDelta(name=self.function if first else None, arguments=out.new_text)
            call = ToolCallDelta(
                index=0, id=call_id if first else None, type="function" if first else None, function=function
            )
            return DeltaMessage(tool_calls=[call]), False
        if self.tool_mode == "required":  # a list of calls: shown once it parses, at the choice's end
            text = self._buffers[out.index] = self._buffers.get(out.index, "") + out.new_text
            if out.finish_reason is None:
                return DeltaMessage(), False
            calls = self.parse_calls(text)
            if calls is None:
                return DeltaMessage(content=text), False
            deltas = [
                ToolCallDelta(
                    index=i,
                    id=c.id,
                    type="function",
                    function=FunctionCallDelta(name=c.function.name, arguments=c.function.arguments),
                )
                for i, c in enumerate(calls)
            ]
            return DeltaMessage(tool_calls=deltas), True
        return (DeltaMessage(content=out.new_text) if out.new_text else DeltaMessage()), False


class CompletionRenderer:
    def __init__(
        self, body: CompletionRequest, tokenizer: Tokenizer | None, prompt: list[int], show_token_ids: bool
    ) -> None:
        self.tokens = TokenText(tokenizer)
        self.echo = body.echo
        self.prompt = prompt
        self.prompt_text = tokenizer.decode(prompt) if body.echo and tokenizer is not None else ""
        self.show_token_ids = show_token_ids
        self._offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        self._echoed: set[int] = set()

    def choice(self, out: RequestOutput) -> CompletionChoice:
        text = out.new_text
        logprobs = None
        if self.echo and out.index not in self._echoed:
            self._echoed.add(out.index)
            text = self.prompt_text + text
            if out.logprobs is not None:
                logprobs = self._logprobs(self.prompt, out.prompt_logprobs or [None] * len(self.prompt), out.index)
        if out.logprobs is not None:
            more = self._logprobs(out.new_token_ids, out.logprobs, out.index)
            logprobs = more if logprobs is None else _join(logprobs, more)
        return CompletionChoice(
            index=out.index,
            text=text,
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            token_ids=out.new_token_ids if self.show_token_ids else None,
        )

    def _logprobs(self, token_ids: list[int], entries: Sequence[TokenLogprob | None], index: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        offset = self._offsets.get(index, 0)
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self.tokens.text(token_id)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            result.token_logprobs.append(None if entry is None else entry.logprob)
            result.top_logprobs.append(None if entry is None else {self.tokens.text(t): lp for t, lp in entry.top})
        self._offsets[index] = offset
        return result


def _join(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )
