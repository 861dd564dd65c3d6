"""Tool calls the model chose (tool_choice "auto"), read from its text by the engine's tool-call parser
(engine/tool_parsers): whole for a non-stream choice, or streamed as OpenAI streams them: each call's id, type and
name once its name is whole, then its arguments in fragments as they come, with the text before the calls as content.
A tail that may be the start of a call is held back until the next token says (hermes' "<tool_c..."), so content
never shows a call's opening."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from tokenweir.engine.api.responses import (
    AssistantMessage,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from tokenweir.engine.tool_parsers import ToolParser


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Streamed:
    """What one choice's stream has shown so far."""

    text: str = ""
    content_sent: int = 0
    call_ids: list[str] = field(default_factory=list)
    arguments_sent: list[int] = field(default_factory=list)


class ChosenCalls:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._streams: dict[int, _Streamed] = {}

    def message(self, text: str) -> tuple[AssistantMessage, bool]:
        """A whole choice's message, and whether it holds calls. A call cut short (max_tokens) is left out: every call
        returned is whole, so it validates against its function's schema."""
        parsed = self.parser.parse(text, final=True)
        calls = [
            ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in parsed.calls
            if c.complete and c.name is not None
        ]
        if not calls:
            return AssistantMessage(content=text if not parsed.calls else parsed.content or None), False
        return AssistantMessage(content=parsed.content if parsed.content.strip() else None, tool_calls=calls), True

    def delta(self, index: int, new_text: str, finished: bool) -> tuple[DeltaMessage, bool]:
        """The next chunk's delta of choice `index`, and whether the choice has shown calls so far."""
        shown = self._streams.setdefault(index, _Streamed())
        shown.text += new_text
        parsed = self.parser.parse(shown.text, final=finished)
        content = parsed.content[shown.content_sent :] or None
        shown.content_sent = max(shown.content_sent, len(parsed.content))
        deltas: list[ToolCallDelta] = []
        for i, call in enumerate(parsed.calls):
            if i == len(shown.call_ids):
                if call.name is None:
                    break  # its name is not whole yet: nothing of it shows
                shown.call_ids.append(tool_call_id())
                shown.arguments_sent.append(len(call.arguments))
                function = FunctionCallDelta(name=call.name, arguments=call.arguments)
                deltas.append(ToolCallDelta(index=i, id=shown.call_ids[i], type="function", function=function))
                continue
            more = call.arguments[shown.arguments_sent[i] :]
            if more:
                shown.arguments_sent[i] = len(call.arguments)
                deltas.append(ToolCallDelta(index=i, function=FunctionCallDelta(arguments=more)))
        return DeltaMessage(content=content, tool_calls=deltas or None), bool(shown.call_ids)
