"""The hermes format (NousResearch's Hermes 2 Pro; Qwen 2.5 writes it too): text, then calls, each
`<tool_call>\\n{"name":...,"arguments":{...}}\\n</tool_call>`, several separated by a newline."""

from __future__ import annotations

from typing import Any

from tokenweir.common.text.tool_prompt import HERMES_CALL_CLOSE, HERMES_CALL_OPEN
from tokenweir.engine.tool_parsers.base import ParsedOutput, PartialCall, ToolParser, held_back, text_without

_TAG = HERMES_CALL_OPEN.rstrip("\n")  # "<tool_call>": where a call begins, wherever the text is
_CLOSE_TAG = HERMES_CALL_CLOSE.lstrip("\n")


class HermesToolParser(ToolParser):
    name = "hermes"
    argument_key = "arguments"

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        more = " (NEXT call CLOSE)*" if parallel else ""
        return "\n".join(
            [
                "%llguidance {}",
                f"start: TEXT | OPEN call CLOSE{more}",
                f"call: %json {self.calls_schema(tools)}",
                f"TEXT: {text_without(_TAG)}",
                # The text before the first call and its opening tag are one lexeme, so the lexer never has to
                # take back a "<" it gave to the text.
                f'OPEN: {text_without(_TAG)} "{_TAG}\\n"',
                f'CLOSE: "\\n{_CLOSE_TAG}"',
                f'NEXT: "\\n{_TAG}\\n"',
            ]
        )

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(_TAG)
        if first < 0:
            return ParsedOutput(text if final else text[: len(text) - held_back(text, _TAG)], [])
        calls: list[PartialCall] = []
        start = first + len(HERMES_CALL_OPEN)
        while start <= len(text):
            call, end = self.scan_call(text, start)
            calls.append(call)
            if end is None or (following := text.find(HERMES_CALL_OPEN, end)) < 0:
                break
            start = following + len(HERMES_CALL_OPEN)
        return ParsedOutput(text[:first], calls)
