"""A chat answer as the Responses API's `response` object (pure functions): the envelope a response echoes of its
request, its output items (a `message` with `output_text`, `function_call`s), its status and usage.

The stream's translation (gateway/openai/responses_stream.py) builds the same objects from chunks, so a streamed
response and a whole one, retrieved later or not, read the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Item = dict[str, Any]

# A chat's finish_reason -> why a response is incomplete (None: it completed)
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
# Echoed as the request set them, else OpenAI's defaults
_ECHOED = {
    "instructions": None,
    "max_output_tokens": None,
    "previous_response_id": None,
    "temperature": None,
    "top_p": None,
    "user": None,
}


def envelope(body: dict[str, Any], response_id: str, created_at: int) -> dict[str, Any]:
    """A response's fields before any output: what it echoes of its request (`body`, validated against RESPONSES)."""
    out: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "model": body["model"],
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": [{"strict": None, "description": None, "parameters": None, **t} for t in body.get("tools") or []],
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "truncation": "disabled",
        "store": body.get("store") is not False,
        "metadata": body.get("metadata") or {},
        "usage": None,
    }
    out |= {k: body[k] if body.get(k) is not None else default for k, default in _ECHOED.items()}
    return out


def finished(envelope: dict[str, Any], output: list[Item], finish_reason: str | None, usage: Any) -> dict[str, Any]:
    """The response once its chat ended with `finish_reason`, with its chat `usage`."""
    reason = _INCOMPLETE.get(finish_reason or "")
    status = "incomplete" if reason is not None else "completed"
    return envelope | {
        "status": status,
        "incomplete_details": {"reason": reason} if reason is not None else None,
        "output": output,
        "usage": response_usage(usage),
    }


def response_usage(usage: Any) -> dict[str, Any] | None:
    """A chat usage as a response's (None where the upstream reported none)."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details")
    cached = int((details.get("cached_tokens") if isinstance(details, dict) else 0) or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def passed_through(response: dict[str, Any], envelope: dict[str, Any]) -> dict[str, Any]:
    """A response an upstream made (a pool that serves /v1/responses) as this gateway's: its id and time, the model
    as the client named it, and what it echoes of the request that only this gateway read (the upstream was sent the
    earlier turns in its input, and told not to store it)."""
    ours = ("id", "created_at", "model", "previous_response_id", "store", "metadata")
    return {**response, **{k: envelope[k] for k in ours}}


def chat_usage(response: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """A response's usage as chat's (what settle bills), and how its chat would have finished; (None, ...) where it
    reported no usage."""
    details = response.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, dict) else None
    finish = "length" if reason == "max_output_tokens" else "content_filter" if reason == "content_filter" else "stop"
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return None, finish
    prompt, completion = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
    cached = usage.get("input_tokens_details")
    cached_tokens = int((cached.get("cached_tokens") if isinstance(cached, dict) else 0) or 0)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return out | {"prompt_tokens_details": {"cached_tokens": cached_tokens}}, finish


def message_item(item_id: str, text: str, status: str, refusal: str | None = None) -> Item:
    content: list[dict[str, Any]] = []
    if text or not refusal:
        content.append({"type": "output_text", "text": text, "annotations": []})
    if refusal:
        content.append({"type": "refusal", "refusal": refusal})
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Item:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def from_chat(chat: dict[str, Any], envelope: dict[str, Any], new_id: Callable[[str], str]) -> dict[str, Any]:
    """The whole response of a chat completion (its first choice: a response has one)."""
    choices = chat.get("choices")
    choice: dict[str, Any] = (
        choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    )
    message: dict[str, Any] = choice["message"] if isinstance(choice.get("message"), dict) else {}
    finish = choice.get("finish_reason")
    status = "incomplete" if finish in _INCOMPLETE else "completed"
    output: list[Item] = []
    text, refusal = message.get("content"), message.get("refusal")
    calls: list[Any] = message["tool_calls"] if isinstance(message.get("tool_calls"), list) else []
    if (isinstance(text, str) and text) or isinstance(refusal, str) or not calls:
        output.append(message_item(new_id("msg"), text if isinstance(text, str) else "", status, refusal or None))
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        call_id = call.get("id") if isinstance(call.get("id"), str) else new_id("call")
        name, arguments = str(function.get("name") or ""), str(function.get("arguments") or "")
        output.append(function_call_item(new_id("fc"), call_id, name, arguments, status))
    return finished(envelope, output, finish, chat.get("usage"))
