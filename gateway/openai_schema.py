"""The /v1 request schemas: what /v1/chat/completions and /v1/completions accept, as strict pydantic TypedDicts.

`CHAT` and `COMPLETION` are the TypeAdapters the routes validate with (see gateway.body) and publish in the OpenAPI
document. Strict mode: "100" is not an integer, "false" is not a boolean, 1.5 is not an integer (numbers may be
written as integers, as OpenAI accepts). Unknown fields pass through untouched (extra="allow").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired, Required, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, with_config
from pydantic.json_schema import SkipJsonSchema
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

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


MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _role_tag(message) -> str | None:
    role = message.get("role") if isinstance(message, dict) else None
    return f"~{role}" if isinstance(role, str) and role in MESSAGE_ROLES else None


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


# Tools. A function's name is what OpenAI accepts (letters, digits, '_' and '-', at most 64); its parameters are a
# JSON Schema whose top level describes an object. Tool types other than 'function' pass through to the upstream.
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="[A-Za-z0-9_-]{1,64}")]


@with_config(_STRICT)
class FunctionParameters(TypedDict, total=False):
    """A JSON Schema object; only its top level is checked (an object schema), the rest is the upstream's."""

    type: Literal["object"]
    properties: dict[str, Any]
    required: list[str]


@with_config(_STRICT)
class FunctionDefinition(TypedDict):
    name: FunctionName
    description: NotRequired[str]
    parameters: NotRequired[Annotated[FunctionParameters, Field(description="A JSON Schema object.")]]
    strict: NotRequired[bool | None]


@with_config(_STRICT)
class FunctionTool(TypedDict):
    type: Literal["function"]
    function: FunctionDefinition


@with_config(_STRICT)
class OtherTool(TypedDict):
    """A tool type the gateway does not know ('custom', a vendor's): passed through to the upstream."""

    type: Annotated[str, Field(json_schema_extra={"not": {"enum": ["function"]}})]


def _tool_tag(tool) -> str | None:
    if not isinstance(tool, dict):
        return None
    kind = tool.get("type")
    return "~function" if kind == "function" else "~other"


Tool = Annotated[
    Union[  # noqa: UP007
        Annotated[FunctionTool, Tag("~function")],
        Annotated[OtherTool, Tag("~other")],
    ],
    Discriminator(_tool_tag, custom_error_type="invalid_type", custom_error_message="expected a tool object"),
]


@with_config(_STRICT)
class NamedFunction(TypedDict):
    name: FunctionName


@with_config(_STRICT)
class NamedToolChoice(TypedDict):
    type: str
    function: NotRequired[NamedFunction]


# response_format: one of OpenAI's three types; json_schema carries a named schema.
@with_config(_STRICT)
class JSONSchemaFormat(TypedDict):
    name: FunctionName
    description: NotRequired[str]
    schema: NotRequired[Annotated[dict[str, Any], Field(description="A JSON Schema object.")]]
    strict: NotRequired[bool | None]


@with_config(_STRICT)
class TextFormat(TypedDict):
    type: Literal["text"]


@with_config(_STRICT)
class JSONObjectFormat(TypedDict):
    type: Literal["json_object"]


@with_config(_STRICT)
class JSONSchemaResponseFormat(TypedDict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


_FORMAT_TYPES = ("text", "json_object", "json_schema")


@with_config(_STRICT)
class UnknownFormat(TypedDict):
    """Only there to word the error of a missing or unknown `type` (left out of the OpenAPI document)."""

    type: Literal["text", "json_object", "json_schema"]


def _format_tag(fmt) -> str | None:
    if not isinstance(fmt, dict):
        return None
    kind = fmt.get("type")
    return f"~{kind}" if isinstance(kind, str) and kind in _FORMAT_TYPES else "~unknown"


ResponseFormat = Annotated[
    Union[  # noqa: UP007
        Annotated[TextFormat, Tag("~text")],
        Annotated[JSONObjectFormat, Tag("~json_object")],
        Annotated[JSONSchemaResponseFormat, Tag("~json_schema")],
        Annotated[SkipJsonSchema[UnknownFormat], Tag("~unknown")],
    ],
    Discriminator(
        _format_tag,
        custom_error_type="invalid_type",
        custom_error_message="expected an object with 'type' 'text', 'json_object' or 'json_schema'",
    ),
]


Stop = _one_of("a string or an array of strings", string=str, array=list[str])
ToolChoice = _one_of(
    "a string ('none', 'auto' or 'required') or an object",
    string=Literal["none", "auto", "required"],
    object=NamedToolChoice,
)
FunctionCallChoice = _one_of(
    "a string ('none' or 'auto') or an object with a 'name'", string=Literal["none", "auto"], object=NamedFunction
)
# logit_bias: token ids written as strings, each mapped to a bias in [-100, 100]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$", description="A token id, as a string.")]
LogitBias = dict[TokenIdKey, Annotated[int, Field(ge=-100, le=100)]]
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
    n: Annotated[int, _between(1, 128, "Choices to generate; output is reserved for n x max_tokens.")] | None
    stream: bool | None
    stream_options: StreamOptions | None
    stop: Stop | None
    user: str | None
    seed: Annotated[int, _between(-_INT64, _INT64 - 1)] | None
    presence_penalty: Penalty | None
    frequency_penalty: Penalty | None
    logit_bias: LogitBias | None
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
    function_call: FunctionCallChoice | None
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


# --- /v1/embeddings ---------------------------------------------------------------------------------------------

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on the inputs of one request
NonEmpty = Annotated[str, Field(min_length=1)]
EmbeddingInput = Annotated[
    Union[  # noqa: UP007
        Annotated[NonEmpty, Tag("~string")],
        Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS), Tag("~strings")],
        Annotated[TokenIds, Tag("~tokens")],
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS), Tag("~token_lists")],
    ],
    Discriminator(
        _prompt_tag,
        custom_error_type="invalid_type",
        custom_error_message="expected a string, an array of strings, an array of token ids (integers >= 0) "
        "or an array of arrays of token ids",
    ),
]


@with_config(_STRICT)
class EmbeddingRequest(TypedDict, total=False):
    """/v1/embeddings. Unknown fields pass through to the upstream."""

    model: Required[Annotated[str, Field(min_length=1)]]
    input: Required[EmbeddingInput]
    encoding_format: Literal["float", "base64"] | None
    dimensions: Annotated[int, _between(1, 65536)] | None
    user: str | None
    priority: Priority


EMBEDDING = TypeAdapter(EmbeddingRequest)
