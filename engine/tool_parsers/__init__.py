"""Tool-call parsers, as vLLM names them (`--tool-call-parser`): how a model writes the calls it chooses to make,
the grammar that keeps those calls to the offered functions and their schemas, and how its text becomes calls."""

from __future__ import annotations

from tokenweir.engine.tool_parsers.base import ParsedOutput, PartialCall, ToolParser
from tokenweir.engine.tool_parsers.hermes import HermesToolParser
from tokenweir.engine.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}

__all__ = ["TOOL_PARSERS", "ParsedOutput", "PartialCall", "ToolParser", "tool_parser"]


def tool_parser(name: str | None) -> ToolParser | None:
    """The parser called `name`; None for None or "none" (no calls the model chooses: tool_choice "auto" is refused)."""
    if name is None or name == "none":
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}: choose from {', '.join(TOOL_PARSERS)} or none")
    return TOOL_PARSERS[name]()
