"""A request body that fails its schema, worded once for the gateway's API, its admin API and the engine's API (each
keeping the codes its clients read): the first pydantic error becomes an OpenAI 400 naming the field."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from tokenweir.common.http.errors import APIError

_EXPECTED = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}
_KINDS: tuple[tuple[type[Any], str, str], ...] = (
    (bool, "a boolean", "booleans"),
    (int, "an integer", "integers"),
    (float, "a number", "numbers"),
    (str, "a string", "strings"),
    (list, "an array", "arrays"),
    (dict, "an object", "objects"),
    (type(None), "null", "nulls"),
)
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
# Where FastAPI found the field: not part of its name.
_SOURCES = ("body", "query", "path", "header")
# pydantic's own names for the branches of an untagged union ('str', 'list[int]', 'function-after[...]'): the field
# ends before them. Our tagged unions' branches are named '~...' and are skipped (gateway/openai/strict.py).
_UNION_BRANCH = re.compile(r"[\[\]()]|^(str|int|float|bool|list|dict|none|function-.*)$")


def validation_error(
    errors: Iterable[Mapping[str, Any]],
    *,
    codes: Mapping[str, str] | None = None,
    brackets: bool = False,
    patterns: Mapping[str, str] | None = None,
    pydantic_words: bool = False,
) -> APIError:
    """The first pydantic error -> OpenAI's 400, `param` the field's path ('messages.0.content').

    Each API keeps what its clients already read: `codes` renames codes (the engine answers 'invalid_request' for all
    but unparseable JSON; the admin API calls a wrong type 'invalid_value'), `brackets` writes list items as
    'messages[0].role' (the engine), `pydantic_words` says the problem in pydantic's words ('Input should be less
    than or equal to 100', the admin API) rather than OpenAI's. `patterns` says what a regex means."""
    codes = codes or {}
    errors = list(errors)
    if not errors:
        return APIError(400, "The request body is invalid.", codes.get("invalid_value", "invalid_value"))
    # A union reports one error per branch; a value_error (a validator's own check) is the one the client can act on.
    err = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    kind, value = err.get("type"), err.get("input")
    if kind == "json_invalid":
        return APIError(400, "We could not parse the JSON body of your request.", "invalid_json")
    path = _field_path(err.get("loc", ()))
    if path and path[-1] == "[key]":  # a dict's key failed (logit_bias): name the key, say what keys must be
        path = path[:-1]
        if kind == "string_pattern_mismatch":
            kind, err = "key_invalid", {**err, "msg": "keys must be token ids written as strings ('50256')"}
    if kind == "invalid_message":  # a message whose role picks no message type: name `role`, or the message
        kind, value, path = _message_error(value, path)
    param = _join(path, brackets) or None
    code = _KIND_CODES.get(kind, "invalid_type" if kind in _EXPECTED else "invalid_value")
    words = _pydantic_words if pydantic_words else _openai_words
    return APIError(400, words(kind, err, value, param, patterns or {}), codes.get(code, code), param=param)


_KIND_CODES: dict[str | None, str] = {  # keyed by an error's type (None: an error without one)
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "invalid_type": "invalid_type",
}


def _field_path(loc: Iterable[str | int]) -> list[str | int]:
    loc = list(loc)
    if loc and loc[0] in _SOURCES:
        loc = loc[1:]
    path: list[str | int] = []
    for part in loc:
        if isinstance(part, str) and part.startswith("~"):
            continue
        if isinstance(part, str) and part != "[key]" and _UNION_BRANCH.search(part):
            break
        path.append(part)
    return path


def _join(path: list[str | int], brackets: bool) -> str:
    if not brackets:
        return ".".join(str(part) for part in path)
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else ("." if text else "") + str(part)
    return text


def _pydantic_words(
    kind: str | None, err: Mapping[str, Any], value: Any, param: str | None, patterns: Mapping[Any, str]
) -> str:
    message = str(err.get("msg", "Invalid value")).removeprefix("Value error, ")
    if kind == "string_pattern_mismatch":
        message = patterns.get((err.get("ctx") or {}).get("pattern"), message)
    elif kind == "string_unicode":
        message = "expected valid Unicode text (no lone surrogates)"
    return f"Invalid '{param}': {message}." if param else f"Invalid request body: {message}."


def _openai_words(
    kind: str | None, err: Mapping[str, Any], value: Any, param: str | None, patterns: Mapping[Any, str]
) -> str:
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "missing":
        return f"Missing required parameter: '{param}'." if param else "The request body is required."
    if kind == "extra_forbidden":
        return f"Unknown parameter: '{param}'."
    where = f"'{param}'" if param else "the request body"
    if kind == "invalid_type" or kind in _EXPECTED:
        expected = msg if kind == "invalid_type" else f"expected {_EXPECTED[kind]}"
        return f"Invalid type for {where}: {expected}, but got {_got(value)} instead."
    ctx = err.get("ctx") or {}
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()), None)
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        message = f"expected a value {_BOUNDS[kind]} {bound}, but got {_shown(value)} instead"
    elif kind in ("literal_error", "role_invalid"):
        message = f"expected one of {ctx.get('expected')}, but got {_shown(value)} instead"
    elif kind in ("too_short", "string_too_short") and not value:
        message = (
            "expected a non-empty " + ("string" if kind == "string_too_short" else "array") + ", but got an empty one"
        )
    elif kind == "string_pattern_mismatch":
        meaning = patterns.get(ctx.get("pattern")) or f"expected a string matching {ctx.get('pattern')}"
        message = f"{meaning}, but got {_shown(value)} instead"
    elif kind == "string_unicode":
        message = "expected valid Unicode text (no lone surrogates)"
    else:
        message = msg[0].lower() + msg[1:] if msg else "invalid value"
    return f"Invalid value for {where}: {message}."


def _message_error(message: Any, path: list[str | int]) -> tuple[str, Any, list[str | int]]:
    if not isinstance(message, dict):
        return "dict_type", message, path
    if "role" not in message:
        return "missing", None, [*path, "role"]
    role = message["role"]
    return ("string_type" if not isinstance(role, str) else "role_invalid"), role, [*path, "role"]


def _got(value: Any) -> str:
    """The JSON kind of a value, as error messages name it ('a string', 'an array of objects')."""
    for tp, one, _ in _KINDS:
        if isinstance(value, tp):
            if tp is list and value:
                return "an array of " + next((many for t, _, many in _KINDS if isinstance(value[0], t)), "values")
            return one
    return type(value).__name__


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
