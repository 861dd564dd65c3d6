"""Request bodies in: parse once with orjson, bound the nesting depth, validate against a schema, and word every
refusal as OpenAI does (`validation_error`, common/http/errors.py: the wording the admin and engine APIs share).

Every refusal is an OpenAI-style 400 whose `param` is the field as a dotted path ('messages.0.content.0.text'), never
a 500. The dict that goes upstream is the client's own, untouched. The schemas themselves live in gateway.openai.schema.
"""

from __future__ import annotations

import threading
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from tokenweir.common.http.errors import APIError
from tokenweir.common.http.validation import validation_error

# Deepest JSON accepted, objects and arrays counted (the body itself is level 1). orjson.loads refuses past 1024
# levels, but the body goes upstream re-encoded and orjson.dumps stops at 255: refuse clearly here, far below both.
MAX_DEPTH = 64

# --- parsing ----------------------------------------------------------------------------------------------------


def orjson_body(raw: bytes) -> dict:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise APIError(400, "We could not parse the JSON body of your request.", "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", "invalid_json")
    return data


def check_body(data: dict, raw: bytes, schema: TypeAdapter) -> dict:
    """Validate a body parsed from `raw` against `schema` (CHAT, COMPLETION or EMBEDDING); returns the body itself,
    untouched."""
    # Fewer brackets than the limit cannot nest past it: counting them is the cheapest check while a body is small.
    if (len(raw) > _COUNT_MAX or raw.count(b"{") + raw.count(b"[") > MAX_DEPTH) and nests_too_deep(data):
        where = too_deep(data, MAX_DEPTH)
        under = f" (under '{where}')" if where is not None else ""
        raise APIError(
            400,
            f"The JSON body is nested too deeply{under}: at most {MAX_DEPTH} levels of objects and arrays are "
            "accepted.",
            "invalid_json",
            param=where,
        )
    try:
        schema.validate_python(data)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
    check_together(data)
    check_gateway_fields(data)
    return data


# Fields an engine reads as an instruction from the gateway rather than as a request parameter: only the gateway
# speaks for a request to an engine, so a client's copy is refused, never passed on (a client's kv_transfer_params
# reached a decode engine whenever no prefill hop ran, naming the address it fetched KV from).
GATEWAY_FIELDS = {
    "kv_transfer_params": "the gateway sets it on the hops of a disaggregated pool",
}


def check_gateway_fields(data: dict) -> None:
    for name, why in GATEWAY_FIELDS.items():
        if name in data:
            raise APIError(
                400,
                f"Unsupported parameter: '{name}' must not come from a client ({why}); leave it out.",
                "unsupported_parameter",
                param=name,
            )


def check_together(data: dict) -> None:
    """What one field cannot say alone, as OpenAI refuses it: top_logprobs without logprobs, best_of below n, a
    chat-only length bound on /v1/completions."""
    if "prompt" in data and data.get("max_completion_tokens") is not None:
        # OpenAI's completions endpoint refuses it and vLLM's ignores it, generating max_tokens: taking it would
        # bound the reservation by a number the upstream never reads.
        raise APIError(
            400,
            "Unsupported parameter: 'max_completion_tokens' is a /v1/chat/completions parameter; /v1/completions "
            "bounds its output with 'max_tokens'. Send max_tokens instead.",
            "unsupported_parameter",
            param="max_completion_tokens",
        )
    if data.get("top_logprobs") is not None and data.get("logprobs") is not True and "messages" in data:
        raise APIError(
            400,
            "Invalid value for 'top_logprobs': it needs 'logprobs' set to true; set logprobs: true or leave "
            "top_logprobs out.",
            "invalid_value",
            param="top_logprobs",
        )
    n, best_of = data.get("n"), data.get("best_of")
    if isinstance(best_of, int) and best_of and best_of < (n or 1):
        raise APIError(
            400,
            f"Invalid value for 'best_of': it must be at least 'n' ({n or 1}), but got {best_of}.",
            "invalid_value",
            param="best_of",
        )


# --- nesting depth ----------------------------------------------------------------------------------------------
#
# A small body with few brackets skips this (see check_body). Otherwise the check is orjson's own recursion guard,
# in Rust: the body, wrapped in (orjson's limit - MAX_DEPTH) lists, is encoded once and fails exactly when it nests
# deeper than MAX_DEPTH. That costs ~1 us plus ~3 us per 100 KB, where counting brackets costs ~50 us per 100 KB
# and a walk in Python ~1 us per dozen objects (8 tools with their JSON schemas: ~9 us). Where orjson has no limit
# to lean on, the walk does the check.

_COUNT_MAX = 4096  # bytes: up to this size, counting the body's brackets first is cheaper than any check


def _dumps_depth_limit() -> int | None:
    """The deepest nesting orjson.dumps encodes (255 in orjson 3.x), or None if it has none below 2048."""
    value: list = []
    for depth in range(1, 2049):
        try:
            orjson.dumps(value)
        except orjson.JSONEncodeError:
            return depth - 1
        value = [value]
    return None


_DUMPS_LIMIT = _dumps_depth_limit()
_PADDING = _DUMPS_LIMIT - MAX_DEPTH if _DUMPS_LIMIT is not None and _DUMPS_LIMIT > MAX_DEPTH else None
_pads = threading.local()  # one reusable chain of lists per thread (apps may run in several threads' loops)


def nests_too_deep(data) -> bool:
    """True if `data` nests objects and arrays more than MAX_DEPTH levels deep (a dict or list is level 1)."""
    if _PADDING is None:
        return _deeper_than(data, MAX_DEPTH)
    pad = getattr(_pads, "chain", None)
    if pad is None:
        outer: list[Any]  # nested lists, one level per padding step
        inner = outer = [None]
        for _ in range(_PADDING - 1):
            outer = [outer]
        pad = _pads.chain = (outer, inner)
    outer, inner = pad
    inner[0] = data
    try:
        orjson.dumps(outer)
    except orjson.JSONEncodeError:  # orjson.loads made `data`: nothing in it but depth can fail to encode
        return True
    finally:
        inner[0] = None
    return False


def too_deep(data: dict, limit: int) -> str | None:
    """The top-level field under which `data` nests past `limit` levels (the body itself is level 1), or None.
    A walk in Python, breadth-first, level by level: no recursion a hostile body could exhaust."""
    return next((key for key, value in data.items() if _deeper_than(value, limit - 1)), None)


def _deeper_than(value, limit: int) -> bool:
    level, depth = [value], 1
    while level:
        if depth > limit:
            return True
        below = []
        for node in level:
            if type(node) is dict:
                node = node.values()
            elif type(node) is not list:
                continue
            for item in node:
                if type(item) is dict or type(item) is list:
                    below.append(item)
        level, depth = below, depth + 1
    return False
