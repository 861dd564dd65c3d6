"""How a chat with tools becomes the messages a chat template renders, for each tool-call format.

A template that renders tools itself (it reads a `tools` variable, as Qwen's, Llama 3.1's and Hermes' do) gets them
as transformers passes them: the tools list beside the messages, and each assistant turn's calls with their
arguments as objects. A template that does not (SmolLM2's) gets the format's own text instead, so the model sees the
functions it may call and the calls and results of earlier turns:
- hermes (NousResearch's Hermes 2 Pro format, which Qwen 2.5 also uses): the functions as JSON inside
  `<tools></tools>` in the system message, each call as `<tool_call>\\n{"name":...,"arguments":{...}}\\n</tool_call>`,
  results as `<tool_response>\\n...\\n</tool_response>` in a user turn;
- llama3_json (Llama 3.1's JSON tool calling): the functions as JSON in the system message, each call as
  `{"name":...,"parameters":{...}}`, several joined with "; ", results as a user turn.
Consecutive tool results share one user turn, so templates that insist on alternating roles still render.

The engine renders prompts so and the gateway counts them so (both call `tool_conversation`): one rendering, or the
reserved prompt tokens drift from what the engine bills. Calls are rendered as compact JSON, which is what the engine's
grammar makes the model write, so an agent's next turn repeats the previous one's tokens and hits the prefix cache.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

TOOL_CALL_FORMATS = ("hermes", "llama3_json")

HERMES_CALL_OPEN = "<tool_call>\n"
HERMES_CALL_CLOSE = "\n</tool_call>"
LLAMA3_CALL_SEPARATOR = "; "

_HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_LLAMA3_SYSTEM = (
    "You have access to the following functions. To call a function, respond with a JSON object in the format "
    '{{"name": function name, "parameters": dictionary of argument name and its value}} and nothing else; '
    'separate several calls with "; ". Do not use variables.\n\n{tools}'
)


def compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def tool_conversation(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: str | None, template_takes_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand the chat template. `messages` are template dicts (common/text/chat_text.py),
    `tools` OpenAI's tool objects (None or empty: none offered), `fmt` one of TOOL_CALL_FORMATS (None: the engine
    parses no tool calls, so earlier calls are shown as the format would have shown them, hermes)."""
    if template_takes_tools:
        return [_with_argument_objects(m) for m in messages], (tools or None)
    fmt = fmt or "hermes"
    assert fmt in TOOL_CALL_FORMATS, fmt
    out: list[dict[str, Any]] = []
    previous_role = None
    for m in messages:
        if m.get("role") == "tool":
            result = _tool_result(m, fmt)
            if previous_role == "tool":  # a run of results: one user turn
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": _calls_text(m, fmt)})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
        previous_role = m.get("role")
    if tools:
        out = _with_tools_prompt(out, tools, fmt)
    return out, None


def _function_specs(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for t in tools if isinstance(t, Mapping) and t.get("type", "function") == "function"]


def _with_tools_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
    specs = _function_specs(tools)
    if fmt == "hermes":
        prompt = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in specs))
    else:
        prompt = _LLAMA3_SYSTEM.format(tools="\n\n".join(json.dumps(t, ensure_ascii=False, indent=4) for t in specs))
    if messages and messages[0].get("role") in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{prompt}".lstrip("\n")
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def call_arguments(call: Mapping[str, Any]) -> Any:
    """A call's arguments as a JSON value: OpenAI sends them as a JSON string, which a client may have mangled (then
    the string itself is shown, as the model would see a malformed call)."""
    function = call.get("function") or {}
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _calls_text(message: Mapping[str, Any], fmt: str) -> str:
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, Mapping)]
    names = [(c.get("function") or {}).get("name", "") for c in calls]
    if fmt == "hermes":
        text = "\n".join(
            f"{HERMES_CALL_OPEN}{compact({'name': n, 'arguments': call_arguments(c)})}{HERMES_CALL_CLOSE}"
            for n, c in zip(names, calls, strict=True)
        )
    else:
        text = LLAMA3_CALL_SEPARATOR.join(
            compact({"name": n, "parameters": call_arguments(c)}) for n, c in zip(names, calls, strict=True)
        )
    content = message.get("content") or ""
    return f"{content}{text}" if fmt == "hermes" else text


def _tool_result(message: Mapping[str, Any], fmt: str) -> str:
    content = message.get("content") or ""
    return f"<tool_response>\n{content}\n</tool_response>" if fmt == "hermes" else content


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    """transformers' form of an assistant turn's calls: arguments as objects (templates apply `tojson` to them)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = dict(message)
    out["tool_calls"] = [
        {**c, "function": {**(c.get("function") or {}), "arguments": call_arguments(c)}}
        for c in calls
        if isinstance(c, Mapping)
    ]
    return out
