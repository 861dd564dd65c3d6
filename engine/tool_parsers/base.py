"""What every tool-call parser does, and the scanning they share.

A parser does two things. Before generation, `grammar` builds the llguidance Lark grammar of an answer: free text, or
calls in the parser's format whose JSON is one of the offered functions, `name` first, then its arguments under the
function's JSON Schema (objects closed to the keys they list, as structured outputs close them), compact (no
whitespace, which a small model otherwise emits forever). So once the model starts a call it can only finish a valid
one (vLLM's auto mode parses whatever comes; this one cannot fail). After, `parse` reads the text, whole or as far as
it has streamed, into the content and the calls; since the grammar fixed the shape, this is a scan, not a search.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from tokenweir.engine.text.response_format import close_objects

# The grammar's JSON is compact, as structured outputs' is (engine/text/structured.py).
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_NAME_PREFIX = '{"name":'


@dataclass(frozen=True)
class PartialCall:
    """One call as far as the text goes: its name once the name is whole, its arguments' JSON text so far, and
    whether the call's JSON object is closed."""

    name: str | None
    arguments: str
    complete: bool


@dataclass(frozen=True)
class ParsedOutput:
    """The text before any call (while streaming, without a tail that may yet start one) and the calls."""

    content: str
    calls: list[PartialCall]


class ToolParser(ABC):
    name: ClassVar[str]
    argument_key: ClassVar[str]  # the key the format writes the arguments under

    @abstractmethod
    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """The Lark grammar (llguidance's dialect) of an answer that may call `tools` (OpenAI function tools); with
        `parallel` False, at most one call."""

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The content and calls of `text`; `final`: the answer is over (nothing is held back as a possible call)."""

    def calls_schema(self, tools: list[dict[str, Any]]) -> str:
        """The `%json` of one call: any of the tools, each `{"name": <its name>, <argument_key>: <its schema>}`."""
        options = []
        for tool in tools:
            function = tool["function"]
            parameters = function.get("parameters") or {"type": "object", "properties": {}}
            options.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": function["name"]}, self.argument_key: close_objects(parameters)},
                    "required": ["name", self.argument_key],
                    "additionalProperties": False,
                }
            )
        return json.dumps({"x-guidance": _COMPACT, "anyOf": options})

    def scan_call(self, text: str, start: int) -> tuple[PartialCall, int | None]:
        """The call whose compact JSON begins at `start`, and the index just past its closing brace (None while it
        is open). The grammar wrote `{"name":"<name>","<argument_key>":<arguments>}`, in that order."""
        open_call = PartialCall(None, "", False)
        name_end = string_end(text, start + len(_NAME_PREFIX)) if text.startswith(_NAME_PREFIX, start) else None
        if name_end is None:
            return open_call, None
        name = json.loads(text[start + len(_NAME_PREFIX) : name_end])
        args_start = name_end + len(f',"{self.argument_key}":')
        if len(text) < args_start:
            return PartialCall(name, "", False), None
        args_end = value_end(text, args_start)
        if args_end is None:
            return PartialCall(name, text[args_start:], False), None
        closed = text.startswith("}", args_end)
        return PartialCall(name, text[args_start:args_end], closed), args_end + 1 if closed else None


def string_end(text: str, start: int) -> int | None:
    """Index just past the JSON string that opens at `start` (a '"'), or None if it is not closed yet."""
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array that opens at `start`, or None if it is not closed yet."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == '"':
            end = string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (kept back from a stream until the
    next token says whether a call begins)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


# Free text that never holds `marker`: Lark's regex intersection and complement, as llguidance reads them.
def text_without(marker: str) -> str:
    return f"/(.|\\n)*/ & ~/(.|\\n)*{_regex_escape(marker)}(.|\\n)*/"


def _regex_escape(literal: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else ("\\n" if c == "\n" else c) for c in literal)
