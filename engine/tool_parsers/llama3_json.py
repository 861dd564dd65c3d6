"""The llama3_json format (Llama 3.1's JSON tool calling): either text, or only calls, each
`{"name":...,"parameters":{...}}`, several joined with "; ". An answer that starts with "{" is calls, so text may
not start with one (the grammar says so)."""

from __future__ import annotations

from typing import Any

from tokenweir.common.text.tool_prompt import LLAMA3_CALL_SEPARATOR
from tokenweir.engine.tool_parsers.base import ParsedOutput, PartialCall, ToolParser


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    argument_key = "parameters"

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        more = f' ("{LLAMA3_CALL_SEPARATOR}" call)*' if parallel else ""
        return "\n".join(
            [
                "%llguidance {}",
                f"start: TEXT | call{more}",
                f"call: %json {self.calls_schema(tools)}",
                "TEXT: /([^{](.|\\n)*)?/",
            ]
        )

    def parse(self, text: str, final: bool) -> ParsedOutput:
        if not text.startswith("{"):
            return ParsedOutput(text, [])
        calls: list[PartialCall] = []
        start = 0
        while True:
            call, end = self.scan_call(text, start)
            calls.append(call)
            if end is None or not text.startswith(LLAMA3_CALL_SEPARATOR, end):
                break
            start = end + len(LLAMA3_CALL_SEPARATOR)
        return ParsedOutput("", calls)
