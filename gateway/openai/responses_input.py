"""A Responses API request as the chat the gateway serves it by (pure functions): its input as items (each with an id,
as a response stores and lists them) and the chat body those items, its instructions and its options make.

The gateway serves /v1/responses through the chat pipeline, so admission, budgets, routing and billing are chat's; only
the shapes differ: instructions become a system message first, an assistant's function calls become its tool_calls
(consecutive calls one assistant turn), a function's output a `tool` message; flat function tools nest under
`function`; `text.format` becomes `response_format`, `max_output_tokens` `max_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenweir.common.http.errors import APIError

Item = dict[str, Any]

# The options a chat body takes under the same name and meaning.
_SAME_NAME = ("temperature", "top_p", "user", "parallel_tool_calls", "priority")
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def input_items(body: dict[str, Any], new_id: Callable[[str], str]) -> list[Item]:
    """The request's `input` as stored items: a string is one user message; each item gets an id (`new_id(prefix)`)
    unless it has one, a message's content becomes a list of parts, every item is `completed`."""
    given = body["input"]
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    return [_item(item, new_id) for item in given]


def _item(item: Item, new_id: Callable[[str], str]) -> Item:
    kind = item.get("type", "message")
    given_id = item.get("id")
    out: Item = {"id": given_id if isinstance(given_id, str) and given_id else new_id(_ID_PREFIXES[kind]), "type": kind}
    if kind == "message":
        role, content = item["role"], item["content"]
        if isinstance(content, str):
            part = "output_text" if role == "assistant" else "input_text"
            content = [{"type": part, "text": content}]
        if role == "assistant":  # as a response's own message item is: annotated output text
            content = [
                {**p, "annotations": p.get("annotations", [])} if p["type"] == "output_text" else p for p in content
            ]
        out |= {"role": role, "content": [dict(p) for p in content]}
    elif kind == "function_call":
        out |= {"call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}
    else:
        out |= {"call_id": item["call_id"], "output": item["output"]}
    out["status"] = "completed"
    return out


def chat_messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """The chat messages of `items` (stored items: ids and parts), after the instructions' system message. An
    earlier output item of another kind (a pool that serves /v1/responses made it: reasoning, a built-in tool's call)
    has no chat turn."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item.get("type")
        if kind not in _ID_PREFIXES:
            continue
        if kind == "function_call":
            function = {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", ""))}
            call = {"id": str(item.get("call_id", "")), "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("_open"):
                last.setdefault("tool_calls", []).append(call)  # the same turn: its text, then its calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call], "_open": True})
        elif kind == "function_call_output":
            output = item["output"]
            text = output if isinstance(output, str) else "".join(_part_text(p) for p in output)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif item.get("role") == "assistant":
            parts = [p for p in item.get("content") or () if isinstance(p, dict)]
            text = "".join(str(p.get("text", "")) for p in parts if p.get("type") in ("output_text", "input_text"))
            message: dict[str, Any] = {"role": "assistant", "content": text, "_open": True}
            refusal = "".join(str(p.get("refusal", "")) for p in parts if p.get("type") == "refusal")
            if refusal:
                message["refusal"] = refusal
            messages.append(message)
        else:
            messages.append({"role": item["role"], "content": _chat_content(item["content"])})
    for message in messages:
        message.pop("_open", None)
    return messages


def _part_text(part: dict[str, Any]) -> str:
    return part.get("text") or part.get("refusal") or ""


def _chat_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A user, system or developer message's content: one text as a string, else chat's parts."""
    if len(parts) == 1 and parts[0]["type"] != "input_image":
        return _part_text(parts[0])
    out: list[dict[str, Any]] = []
    for part in parts:
        if part["type"] == "input_image":
            image = {"url": part["image_url"]} | ({"detail": part["detail"]} if part.get("detail") else {})
            out.append({"type": "image_url", "image_url": image})
        else:
            out.append({"type": "text", "text": _part_text(part)})
    return out


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses' flat function tools in chat's nested form."""
    out = []
    for tool in tools:
        function = {"name": tool["name"]}
        function |= {k: tool[k] for k in ("description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (None for plain text: nothing to ask of the upstream)."""
    if fmt["type"] == "json_schema":
        named = {k: fmt[k] for k in ("name", "schema", "description", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": named}
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return None


# What only this gateway reads of a request: not for an upstream it is passed through to
_OURS = ("previous_response_id", "store", "priority", "stream_options")


def passthrough_body(body: dict[str, Any], items: list[Item]) -> dict[str, Any]:
    """What a pool that serves /v1/responses is sent: the request as the client sent it, its earlier turns (kept
    here) written into its input without this gateway's item ids, and `store: false` (this gateway keeps it)."""
    out = {k: v for k, v in body.items() if k not in _OURS}
    out["input"] = [{k: v for k, v in item.items() if k not in ("id", "status")} for item in items]
    return out | {"store": False}


def chat_body(body: dict[str, Any], items: list[Item]) -> dict[str, Any]:
    """The chat request that serves `body` (validated against RESPONSES) whose whole input, earlier turns included,
    is `items`."""
    messages = chat_messages(body.get("instructions"), items)
    if not messages:
        raise APIError(
            400, "Invalid 'input': it is empty and there are no instructions; send at least one message.",
            "invalid_value", param="input",
        )  # fmt: skip
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    chat |= {k: body[k] for k in _SAME_NAME if body.get(k) is not None}
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    fmt = (body.get("text") or {}).get("format")
    if fmt is not None and (converted := response_format(fmt)) is not None:
        chat["response_format"] = converted
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("stream"):  # the usage chunk is what response.completed reports
        chat |= {"stream": True, "stream_options": {"include_usage": True}}
    return chat
