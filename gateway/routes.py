"""Thin routes: parse and validate the body like OpenAI does, then hand it to the admission pipeline.

Bodies are parsed once with orjson and validated with pydantic in strict mode: "100" is not an integer, "false" is
not a boolean, 1.5 is not an integer (numbers may be written as integers, as OpenAI accepts). The dict that goes
upstream is the client's own, so unknown fields pass through untouched (extra="allow"). Every refusal is an
OpenAI-style 400 whose `param` is the field as a dotted path ('messages.0.content.0.text'), never a 500.

The request schemas are published in the OpenAPI document through `openapi_extra` (built from the same models), so
FastAPI documents the body without parsing it a second time.
"""

from __future__ import annotations

import threading
from typing import Annotated, Any, Literal, NotRequired, Required, Union

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from gateway.admin import ErrorBody
from gateway.auth import Principal, require_key
from gateway.errors import APIError

router = APIRouter()

# Deepest JSON accepted, objects and arrays counted (the body itself is level 1). orjson.loads refuses past 1024
# levels, but the body goes upstream re-encoded and orjson.dumps stops at 255: refuse clearly here, far below both.
MAX_DEPTH = 64
MAX_TOKENS = 2**31 - 1  # max_tokens and token ids: beyond any context window, within every store and engine
_INT64 = 2**63

# --- request schemas ------------------------------------------------------------------------------------------
#
# TypedDicts, validated by pydantic in strict mode: no instances are built (twice as fast as models), and a field
# that may be left out is not thereby nullable. Unions are tagged by a callable discriminator (on the JSON kind, a
# part's `type` or a message's `role`), so a bad value gets one error at its own path rather than one per union
# branch. Tags start with "~": they are not fields, and `validation_error` drops them from `param`.


_STRICT = ConfigDict(extra="allow", strict=True)


def _json_kind(value) -> str | None:
    if isinstance(value, str):
        return "~string"
    if isinstance(value, list):
        return "~array"
    if isinstance(value, dict):
        return "~object"
    return None


def _one_of(expected: str, **members) -> Any:
    """A union picked by the value's JSON kind (string / array / object); anything else is one 'invalid_type'."""
    choices = tuple(Annotated[tp, Tag(f"~{kind}")] for kind, tp in members.items())
    return Annotated[
        Union[choices],  # noqa: UP007 - a tuple of members needs the subscript form
        Discriminator(_json_kind, custom_error_type="invalid_type", custom_error_message=f"expected {expected}"),
    ]


def _between(lo, hi, description: str | None = None) -> Any:
    return Field(ge=lo, le=hi, description=description)


# Content parts. Known types are checked; any other part passes through to the upstream, which decides.
_PART_TYPES = ("text", "image_url", "input_audio", "file", "refusal")


@with_config(_STRICT)
class TextPart(TypedDict):
    type: Literal["text"]
    text: str


@with_config(_STRICT)
class ImageURL(TypedDict):
    url: Annotated[str, Field(description="An http(s) URL or a data: URL.")]
    detail: NotRequired[str | None]


ImageURLValue = _one_of("an object with a string 'url', or a string", object=ImageURL, string=str)


@with_config(_STRICT)
class ImagePart(TypedDict):
    type: Literal["image_url"]
    image_url: ImageURLValue


@with_config(_STRICT)
class InputAudio(TypedDict):
    data: Annotated[str, Field(description="Base64-encoded audio.")]
    format: Annotated[str, Field(description="'wav', 'mp3', ...")]


@with_config(_STRICT)
class AudioPart(TypedDict):
    type: Literal["input_audio"]
    input_audio: InputAudio


@with_config(_STRICT)
class FileRef(TypedDict, total=False):
    file_data: str
    file_id: str
    filename: str


@with_config(_STRICT)
class FilePart(TypedDict):
    type: Literal["file"]
    file: FileRef


@with_config(_STRICT)
class RefusalPart(TypedDict):
    type: Literal["refusal"]
    refusal: str


@with_config(_STRICT)
class OtherPart(TypedDict):
    """A part type the gateway does not know: passed through to the upstream, which decides."""

    type: Annotated[str, Field(json_schema_extra={"not": {"enum": list(_PART_TYPES)}})]


def _part_tag(part) -> str | None:
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    return f"~{kind}" if isinstance(kind, str) and kind in _PART_TYPES else "~other"  # ~other names a bad `type`


ContentPart = Annotated[
    Union[  # noqa: UP007
        Annotated[TextPart, Tag("~text")],
        Annotated[ImagePart, Tag("~image_url")],
        Annotated[AudioPart, Tag("~input_audio")],
        Annotated[FilePart, Tag("~file")],
        Annotated[RefusalPart, Tag("~refusal")],
        Annotated[OtherPart, Tag("~other")],
    ],
    Discriminator(_part_tag, custom_error_type="invalid_type", custom_error_message="expected a content part object"),
]
Content = _one_of(
    "a string or an array of content parts",
    string=str,
    array=Annotated[list[ContentPart], Field(min_length=1)],
)


@with_config(_STRICT)
class FunctionCall(TypedDict):
    name: str
    arguments: Annotated[str, Field(description="JSON text.")]


@with_config(_STRICT)
class ToolCall(TypedDict):
    id: NotRequired[str]
    type: NotRequired[str]
    function: FunctionCall


@with_config(_STRICT)
class SystemMessage(TypedDict):
    role: Literal["system"]
    content: Content
    name: NotRequired[str]


@with_config(_STRICT)
class DeveloperMessage(TypedDict):
    role: Literal["developer"]
    content: Content
    name: NotRequired[str]


@with_config(_STRICT)
class UserMessage(TypedDict):
    role: Literal["user"]
    content: Content
    name: NotRequired[str]


@with_config(_STRICT)
class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: NotRequired[Content | None]
    name: NotRequired[str]
    refusal: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCall] | None]
    function_call: NotRequired[FunctionCall | None]
    audio: NotRequired[dict[str, Any] | None]


@with_config(_STRICT)
class ToolMessage(TypedDict):
    role: Literal["tool"]
    content: NotRequired[Content | None]
    tool_call_id: NotRequired[str]


@with_config(_STRICT)
class FunctionMessage(TypedDict):
    role: Literal["function"]
    content: NotRequired[str | None]
    name: NotRequired[str]


_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _role_tag(message) -> str | None:
    role = message.get("role") if isinstance(message, dict) else None
    return f"~{role}" if isinstance(role, str) and role in _ROLES else None


ChatMessage = Annotated[
    Union[  # noqa: UP007
        Annotated[SystemMessage, Tag("~system")],
        Annotated[DeveloperMessage, Tag("~developer")],
        Annotated[UserMessage, Tag("~user")],
        Annotated[AssistantMessage, Tag("~assistant")],
        Annotated[ToolMessage, Tag("~tool")],
        Annotated[FunctionMessage, Tag("~function")],
    ],
    # validation_error names what is wrong: the message itself, or its `role` (missing, not a string, unknown)
    Discriminator(_role_tag, custom_error_type="invalid_message", custom_error_message="invalid message"),
]


@with_config(_STRICT)
class StreamOptions(TypedDict, total=False):
    include_usage: bool | None
    continuous_usage_stats: bool | None
    include_obfuscation: bool | None


@with_config(_STRICT)
class FunctionDefinition(TypedDict):
    name: str
    description: NotRequired[str]
    parameters: NotRequired[Annotated[dict[str, Any], Field(description="A JSON Schema object.")]]
    strict: NotRequired[bool | None]


@with_config(_STRICT)
class Tool(TypedDict):
    type: str
    function: NotRequired[FunctionDefinition]


@with_config(_STRICT)
class ResponseFormat(TypedDict):
    type: Annotated[str, Field(description="'text', 'json_object' or 'json_schema'.")]
    json_schema: NotRequired[dict[str, Any] | None]


Stop = _one_of("a string or an array of strings", string=str, array=list[str])
ToolChoice = _one_of("a string ('none', 'auto' or 'required') or an object", string=str, object=dict[str, Any])
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _prompt_tag(prompt) -> str | None:
    if isinstance(prompt, str):
        return "~string"
    if isinstance(prompt, list):
        first = prompt[0] if prompt else ""  # [] is an empty array of strings: refused for its length
        if isinstance(first, str):
            return "~strings"
        if isinstance(first, int) and not isinstance(first, bool):
            return "~tokens"
        if isinstance(first, list):
            return "~token_lists"
    return None


Prompt = Annotated[
    Union[  # noqa: UP007
        Annotated[str, Tag("~string")],
        Annotated[list[str], Field(min_length=1), Tag("~strings")],
        Annotated[TokenIds, Tag("~tokens")],
        Annotated[list[TokenIds], Field(min_length=1), Tag("~token_lists")],
    ],
    Discriminator(
        _prompt_tag,
        custom_error_type="invalid_type",
        custom_error_message="expected a string, an array of strings, an array of token ids (integers >= 0) "
        "or an array of arrays of token ids",
    ),
]
MaxTokens = Annotated[int, _between(1, MAX_TOKENS)]
Penalty = Annotated[float, _between(-2, 2)]
Priority = Annotated[
    int, _between(0, 2, "tokenweir: 0 critical, 1 standard, 2 batch; a request may lower its team's, never raise it.")
]


@with_config(_STRICT)
class _Body(TypedDict, total=False):
    """What /v1/chat/completions and /v1/completions share. Unknown fields pass through to the upstream."""

    model: Required[Annotated[str, Field(min_length=1)]]
    max_tokens: MaxTokens | None
    temperature: Annotated[float, _between(0, 2)] | None
    top_p: Annotated[float, _between(0, 1)] | None
    n: Annotated[int, _between(1, 128, "Only 1 is supported.")] | None
    stream: bool | None
    stream_options: StreamOptions | None
    stop: Stop | None
    user: str | None
    seed: Annotated[int, _between(-_INT64, _INT64 - 1)] | None
    presence_penalty: Penalty | None
    frequency_penalty: Penalty | None
    logit_bias: dict[str, Annotated[int, _between(-100, 100)]] | None
    priority: Priority


@with_config(_STRICT)
class ChatCompletionRequest(_Body, total=False):
    messages: Required[Annotated[list[ChatMessage], Field(min_length=1)]]
    max_completion_tokens: MaxTokens | None
    logprobs: bool | None
    top_logprobs: Annotated[int, _between(0, 20)] | None
    tools: list[Tool] | None
    tool_choice: ToolChoice | None
    parallel_tool_calls: bool | None
    response_format: ResponseFormat | None
    functions: list[FunctionDefinition] | None
    function_call: ToolChoice | None
    store: bool | None
    metadata: dict[str, str] | None
    service_tier: str | None
    reasoning_effort: str | None
    modalities: list[str] | None


@with_config(_STRICT)
class CompletionRequest(_Body, total=False):
    prompt: Required[Prompt]
    echo: bool | None
    best_of: Annotated[int, _between(0, 20)] | None
    logprobs: Annotated[int, _between(0, 20)] | None
    suffix: str | None


CHAT = TypeAdapter(ChatCompletionRequest)
COMPLETION = TypeAdapter(CompletionRequest)


# --- parsing ----------------------------------------------------------------------------------------------------


async def parse_body(request: Request, schema: TypeAdapter) -> dict:
    raw = await request.body()
    data = orjson_body(raw)
    request.state.model = data.get("model")  # for the event of a request refused before admission
    return check_body(data, raw, schema)


def orjson_body(raw: bytes) -> dict:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise APIError(400, "We could not parse the JSON body of your request.", "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", "invalid_json")
    return data


def check_body(data: dict, raw: bytes, schema: TypeAdapter) -> dict:
    """Validate a body parsed from `raw` against `schema` (CHAT or COMPLETION); returns the body itself, untouched."""
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
    if data.get("n") not in (None, 1):
        message = "Unsupported value for 'n': only 1 is supported; send separate requests (or leave n out)."
        raise APIError(400, message, "unsupported_value", param="n")
    return data


def parse_json(raw: bytes, schema: TypeAdapter) -> dict:
    """Parse and validate a request body, as the routes do (for benchmarks and tests)."""
    return check_body(orjson_body(raw), raw, schema)


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


# --- errors, as OpenAI words them -----------------------------------------------------------------------------

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
_KINDS = (
    (bool, "a boolean", "booleans"),
    (int, "an integer", "integers"),
    (float, "a number", "numbers"),
    (str, "a string", "strings"),
    (list, "an array", "arrays"),
    (dict, "an object", "objects"),
    (type(None), "null", "nulls"),
)
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _got(value) -> str:
    """The JSON kind of a value, as error messages name it ('a string', 'an array of objects')."""
    for tp, one, _ in _KINDS:
        if isinstance(value, tp):
            if tp is list and value:
                return "an array of " + next((many for t, _, many in _KINDS if isinstance(value[0], t)), "values")
            return one
    return type(value).__name__


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validation_error(errors) -> APIError:
    """The first pydantic error -> OpenAI's 400, `param` the field as a dotted path ('messages.0.content')."""
    err = errors[0]
    loc = list(err.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header"):  # FastAPI's own errors say where the field was
        loc = loc[1:]
    kind, value = err.get("type"), err.get("input")
    path = [str(p) for p in loc if not (isinstance(p, str) and p.startswith("~"))]  # union tags are not fields
    if kind == "invalid_message":  # a message whose role picks no message type: name `role`, or the message
        kind, value, path = _message_error(value, path)
    param = ".".join(path) or None
    msg = err.get("msg", "invalid value")
    if kind == "json_invalid":
        return APIError(400, "We could not parse the JSON body of your request.", "invalid_json")
    if kind == "missing":
        message = f"Missing required parameter: '{param}'." if param else "The request body is required."
        return APIError(400, message, "missing_required_parameter", param=param)
    where = f"'{param}'" if param else "the request body"
    if kind == "invalid_type" or kind in _EXPECTED:
        expected = msg if kind == "invalid_type" else f"expected {_EXPECTED[kind]}"
        message = f"Invalid type for {where}: {expected}, but got {_got(value)} instead."
        return APIError(400, message, "invalid_type", param=param)
    ctx = err.get("ctx") or {}
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()), None)
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        message = f"expected a value {_BOUNDS[kind]} {bound}, but got {_shown(value)} instead"
    elif kind == "literal_error":
        message = f"expected one of {ctx.get('expected')}, but got {_shown(value)} instead"
    elif kind in ("too_short", "string_too_short") and not value:
        message = (
            "expected a non-empty " + ("string" if kind == "string_too_short" else "array") + ", but got an empty one"
        )
    elif kind == "role_invalid":
        message = f"expected one of {', '.join(repr(r) for r in _ROLES)}, but got {_shown(value)} instead"
    else:
        message = msg[0].lower() + msg[1:] if msg else "invalid value"
    return APIError(400, f"Invalid value for {where}: {message}.", "invalid_value", param=param)


def _message_error(message, path: list[str]) -> tuple[str, Any, list[str]]:
    if not isinstance(message, dict):
        return "dict_type", message, path
    if "role" not in message:
        return "missing", None, [*path, "role"]
    role = message["role"]
    return ("string_type" if not isinstance(role, str) else "role_invalid"), role, [*path, "role"]


# --- OpenAPI ----------------------------------------------------------------------------------------------------


def _inline(schema: dict) -> dict:
    """The model's JSON schema with its `$defs` references inlined: self-contained, as `openapi_extra` needs."""
    defs = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**resolve(defs[ref.removeprefix("#/$defs/")]), **resolve(rest)}
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


class Usage(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Choice(BaseModel):
    model_config = ConfigDict(extra="allow")
    index: int
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    """Non-stream answer (`stream: true` gets `text/event-stream` chunks ending with `data: [DONE]`)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class TextCompletion(ChatCompletion):
    object: str = "text_completion"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _err(description: str) -> dict:
    return {"model": ErrorBody, "description": description}


_ERRORS = {
    400: _err("Invalid request: `param` names the field (a dotted path such as 'messages.0.content')."),
    401: _err("Missing, malformed, unknown, revoked or expired API key."),
    403: _err("The key has no team, the team is disabled, or it may not use this model."),
    404: _err("No such model."),
    413: _err("The body is larger than the gateway's limit."),
    429: _err("Rate limit, budget, concurrency or queue full; see `Retry-After`."),
    503: _err("No upstream could serve the request, or the gateway is not ready; retry."),
    504: _err("The upstream timed out."),
}
_SSE = {"text/event-stream": {"schema": {"type": "string", "description": "Server-sent events (stream: true)."}}}


def _inference_doc(schema: TypeAdapter, answer: type[BaseModel]) -> dict:
    return {
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _inline(schema.json_schema())}},
            }
        },
        "responses": {200: {"model": answer, "description": "The completion.", "content": _SSE}, **_ERRORS},
    }


# --- routes -----------------------------------------------------------------------------------------------------


@router.post("/v1/chat/completions", summary="Create a chat completion", **_inference_doc(CHAT, ChatCompletion))
async def chat_completions(request: Request, principal: Principal = Depends(require_key)) -> Response:
    body = await parse_body(request, CHAT)
    return await request.app.state.admission.handle(request, principal, body, "chat")


@router.post("/v1/completions", summary="Create a text completion", **_inference_doc(COMPLETION, TextCompletion))
async def completions(request: Request, principal: Principal = Depends(require_key)) -> Response:
    body = await parse_body(request, COMPLETION)
    return await request.app.state.admission.handle(request, principal, body, "completions")


@router.get(
    "/v1/models",
    summary="List the models this key's team may use",
    responses={200: {"model": ModelList, "description": "The models."}, 401: _ERRORS[401], 403: _ERRORS[403]},
)
async def list_models(request: Request, principal: Principal = Depends(require_key)) -> JSONResponse:
    limits = principal.team.limits if principal.team is not None else None
    models = [
        {"id": name, "object": "model", "created": 0, "owned_by": "tokenweir"}
        for name in request.app.state.upstreams.pools
        if limits is not None and limits.allows_model(name)
    ]
    return JSONResponse({"object": "list", "data": models})
