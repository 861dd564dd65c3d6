"""The fake upstream's /v1/responses (loadtests/fake_upstream.py): an external server that serves OpenAI's Responses
API itself, for a pool with `serves_responses`. Text only, by the fake's token rule (one token per input word, +1 per
input item; `tokens` output tokens, 16 unless max_output_tokens is fewer), whole or streamed as OpenAI's events.

As OpenAI, it refuses what a gateway must not pass on: a `previous_response_id` (it stores nothing of ours) and
chat's `stream_options.include_usage`.
"""

from __future__ import annotations

import time
from typing import Any

import orjson


def refusal(req: dict) -> str | None:
    """Why OpenAI would refuse this body (None: it would not)."""
    if req.get("previous_response_id") is not None:
        return "previous_response_id: no such response here"
    if "include_usage" in (req.get("stream_options") or {}):
        return "Unknown parameter: 'stream_options.include_usage'."
    return None


def prompt_tokens(req: dict) -> int:
    items = req.get("input")
    items = [{"content": items}] if isinstance(items, str) else items if isinstance(items, list) else []
    words = 0
    for item in items:
        content = item.get("content") if isinstance(item, dict) else None
        text = content if isinstance(content, str) else " ".join(str(p.get("text", "")) for p in content or [])
        words += len(text.split()) + 1
    return words + (len(str(req["instructions"]).split()) + 1 if req.get("instructions") else 0)


def answer(req: dict, rid: str, prompt: int, tokens: int) -> dict[str, Any]:
    """The whole response: `tokens` of "tok ", incomplete when that is all max_output_tokens allowed."""
    bound = req.get("max_output_tokens") or 16
    incomplete = tokens >= bound
    text = "tok " * tokens
    message = {
        "id": f"msg_{rid}",
        "type": "message",
        "role": "assistant",
        "status": "incomplete" if incomplete else "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    usage = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + tokens,
    }
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": req.get("model"),
        "output": [message],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
    }


def events(whole: dict[str, Any]) -> list[bytes]:
    """The stream of `whole`, as OpenAI sends it: one SSE event per token, `sequence_number`ed."""
    started = {**whole, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    message = whole["output"][0]
    at = {"item_id": message["id"], "output_index": 0}
    part = {"type": "output_text", "text": "", "annotations": []}
    out: list[dict[str, Any]] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
        {"type": "response.output_item.added", "output_index": 0, "item": {**message, "content": []}},
        {"type": "response.content_part.added", **at, "content_index": 0, "part": part},
    ]
    text = message["content"][0]["text"]
    out += [
        {"type": "response.output_text.delta", **at, "content_index": 0, "delta": "tok ", "logprobs": []}
        for _ in range(whole["usage"]["output_tokens"])
    ]
    out += [
        {"type": "response.output_text.done", **at, "content_index": 0, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **at, "content_index": 0, "part": {**part, "text": text}},
        {"type": "response.output_item.done", "output_index": 0, "item": message},
        {"type": f"response.{whole['status']}", "response": whole},
    ]
    return [
        b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps({**e, "sequence_number": i}) + b"\n\n"
        for i, e in enumerate(out)
    ]
