"""How an OpenAI chat message becomes what a chat template reads: its text parts joined with newlines (as vLLM
joins them), no content as "", and the fields templates use (name, tool_calls, tool_call_id). The engine renders its
prompts so and the gateway counts and hashes them so: one join, or the counts and the prefix hashes drift."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

TEMPLATE_FIELDS = ("name", "tool_calls", "tool_call_id")


def join_text_parts(texts: Iterable[str]) -> str:
    return "\n".join(texts)


def text_parts(content: Iterable[Any]) -> list[str]:
    """The texts of a content list's text parts ({"type": "text", "text": ...}; type defaults to text)."""
    return [
        part["text"]
        for part in content
        if isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str)
    ]


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The dict a chat template expects for one message (a raw OpenAI message, or a validated one dumped)."""
    content = message.get("content")
    if isinstance(content, list):
        content = join_text_parts(text_parts(content))
    out: dict[str, Any] = {"role": message.get("role", "user"), "content": content or ""}
    for key in TEMPLATE_FIELDS:
        if message.get(key) is not None:
            out[key] = message[key]
    return out
