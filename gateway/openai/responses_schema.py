"""What POST /v1/responses accepts: the Responses API's request as a strict pydantic TypedDict (`RESPONSES`), the parts
of OpenAI's API the gateway serves by translating them into a chat (gateway/openai/responses_input.py).

The top level is closed: a field OpenAI does not have is an 'unknown_parameter' 400, and one it has that the gateway
cannot honour (a reasoning effort, background mode, a built-in tool, an input item other than a message or a function
call and its output) an 'unsupported_*' 400 naming it (`check_supported`), never silently dropped. Items and parts are
open, as in chat: an item the client echoes back from an earlier response keeps fields of its own (id, status).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, NotRequired, Required, TypeAlias, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.openai.schema import MaxTokens, Priority
from tokenweir.gateway.openai.strict import STRICT, between, one_of
from tokenweir.gateway.openai.tools import FunctionName, FunctionParameters

CLOSED = ConfigDict(extra="forbid", strict=True)

# --- input items ------------------------------------------------------------------------------------------------

_PART_TYPES = ("input_text", "output_text", "refusal", "input_image")


@with_config(STRICT)
class InputTextPart(TypedDict):
    type: Literal["input_text"]
    text: str


@with_config(STRICT)
class OutputTextPart(TypedDict):
    """An assistant's text: what an earlier response's message item holds, sent back as input."""

    type: Literal["output_text"]
    text: str


@with_config(STRICT)
class RefusalPart(TypedDict):
    type: Literal["refusal"]
    refusal: str


@with_config(STRICT)
class InputImagePart(TypedDict):
    type: Literal["input_image"]
    image_url: Annotated[str, Field(description="An http(s) URL or a data: URL.")]
    detail: NotRequired[Literal["low", "high", "auto"] | None]


def _part_tag(part) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else None
    return f"~{kind}" if kind in _PART_TYPES else None


ContentPart = Annotated[
    Union[  # noqa: UP007
        Annotated[InputTextPart, Tag("~input_text")],
        Annotated[OutputTextPart, Tag("~output_text")],
        Annotated[RefusalPart, Tag("~refusal")],
        Annotated[InputImagePart, Tag("~input_image")],
    ],
    Discriminator(
        _part_tag,
        custom_error_type="invalid_type",
        custom_error_message="expected a content part with 'type' 'input_text', 'output_text', 'refusal' or "
        "'input_image'",
    ),
]
if TYPE_CHECKING:
    Content: TypeAlias = str | list[ContentPart]
else:
    Content = one_of(
        "a string or an array of content parts",
        string=str,
        array=Annotated[list[ContentPart], Field(min_length=1)],
    )


@with_config(STRICT)
class MessageItem(TypedDict):
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    type: NotRequired[Literal["message"]]


@with_config(STRICT)
class FunctionCallItem(TypedDict):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: FunctionName
    arguments: Annotated[str, Field(description="JSON text.")]


@with_config(STRICT)
class FunctionCallOutputItem(TypedDict):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: Annotated[Union[str, list[ContentPart]], Field(description="The function's result.")]  # noqa: UP007


ITEM_TYPES = ("message", "function_call", "function_call_output")


def _item_tag(item) -> str | None:
    if not isinstance(item, dict):
        return None
    kind = item.get("type", "message")
    return f"~{kind}" if kind in ITEM_TYPES else None


InputItem = Annotated[
    Union[  # noqa: UP007
        Annotated[MessageItem, Tag("~message")],
        Annotated[FunctionCallItem, Tag("~function_call")],
        Annotated[FunctionCallOutputItem, Tag("~function_call_output")],
    ],
    Discriminator(_item_tag, custom_error_type="invalid_type", custom_error_message="expected an input item object"),
]
if TYPE_CHECKING:
    Input: TypeAlias = str | list[InputItem]
else:
    Input = one_of("a string or an array of input items", string=str, array=list[InputItem])

# --- tools, tool choice, text format ----------------------------------------------------------------------------


@with_config(STRICT)
class FunctionTool(TypedDict):
    """The Responses API's function tool: flat, where chat nests it under `function`."""

    type: Literal["function"]
    name: FunctionName
    description: NotRequired[str | None]
    parameters: NotRequired[Annotated[FunctionParameters, Field(description="A JSON Schema object.")] | None]
    strict: NotRequired[bool | None]


@with_config(CLOSED)
class FunctionChoice(TypedDict):
    type: Literal["function"]
    name: FunctionName


if TYPE_CHECKING:
    ToolChoice: TypeAlias = Literal["none", "auto", "required"] | FunctionChoice
else:
    ToolChoice = one_of(
        "a string ('none', 'auto' or 'required') or an object {'type': 'function', 'name': ...}",
        string=Literal["none", "auto", "required"],
        object=FunctionChoice,
    )


@with_config(CLOSED)
class TextFormat(TypedDict):
    type: Literal["text"]


@with_config(CLOSED)
class JSONObjectFormat(TypedDict):
    type: Literal["json_object"]


@with_config(CLOSED)
class JSONSchemaFormat(TypedDict):
    type: Literal["json_schema"]
    name: FunctionName
    schema: Annotated[dict[str, Any], Field(description="A JSON Schema object.")]
    description: NotRequired[str | None]
    strict: NotRequired[bool | None]


_FORMAT_TYPES = ("text", "json_object", "json_schema")


def _format_tag(fmt) -> str | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    return f"~{kind}" if kind in _FORMAT_TYPES else None


Format = Annotated[
    Union[  # noqa: UP007
        Annotated[TextFormat, Tag("~text")],
        Annotated[JSONObjectFormat, Tag("~json_object")],
        Annotated[JSONSchemaFormat, Tag("~json_schema")],
    ],
    Discriminator(
        _format_tag,
        custom_error_type="invalid_type",
        custom_error_message="expected an object with 'type' 'text', 'json_object' or 'json_schema'",
    ),
]


@with_config(CLOSED)
class TextConfig(TypedDict, total=False):
    format: Format


@with_config(CLOSED)
class StreamOptions(TypedDict, total=False):
    include_obfuscation: bool | None  # nothing to obfuscate: accepted and ignored


MetadataKey = Annotated[str, Field(max_length=64)]
Metadata = Annotated[dict[MetadataKey, Annotated[str, Field(max_length=512)]], Field(max_length=16)]
ResponseId = Annotated[str, Field(min_length=1, max_length=128)]


@with_config(CLOSED)
class ResponsesRequest(TypedDict, total=False):
    """POST /v1/responses, as far as the gateway serves it (see the module docstring)."""

    model: Required[Annotated[str, Field(min_length=1)]]
    input: Required[Input]
    instructions: str | None
    tools: list[FunctionTool] | None
    tool_choice: ToolChoice | None
    parallel_tool_calls: bool | None
    text: TextConfig | None
    max_output_tokens: MaxTokens | None
    temperature: Annotated[float, between(0, 2)] | None
    top_p: Annotated[float, between(0, 1)] | None
    user: str | None
    metadata: Metadata | None
    stream: bool | None
    stream_options: StreamOptions | None
    store: bool | None
    previous_response_id: ResponseId | None
    priority: Priority


RESPONSES = TypeAdapter(ResponsesRequest)

# --- what OpenAI has and the gateway does not serve -------------------------------------------------------------

# Fields of OpenAI's Responses API the gateway cannot honour, and why; refused unless left at what they default to.
UNSUPPORTED_FIELDS: dict[str, tuple[object, str]] = {
    "background": (False, "background mode is not supported; leave it out and wait for the answer (or stream it)"),
    "conversation": (None, "conversations are not supported; chain responses with 'previous_response_id'"),
    "include": ([], "no extra output data is available; leave it out"),
    "prompt": (None, "stored prompt templates are not supported; send 'instructions' and 'input'"),
    "reasoning": (None, "reasoning settings are not supported by this gateway's models; leave it out"),
    "truncation": ("disabled", "only 'disabled' truncation is supported: a too long input is a 400"),
    "max_tool_calls": (None, "only function tools are supported, and they are called by you; leave it out"),
    "service_tier": (None, "service tiers are not supported; leave it out"),
    "top_logprobs": (None, "log probabilities are not supported on /v1/responses; use /v1/chat/completions"),
    "prompt_cache_key": (None, "the gateway scopes prompt caching itself; leave it out"),
    "prompt_cache_retention": (None, "the gateway scopes prompt caching itself; leave it out"),
    "safety_identifier": (None, "not supported; use 'user' to name your end user"),
    "context_management": (None, "not supported; leave it out"),
}


def check_supported(data: dict[str, Any]) -> None:
    """Refuse, naming it, what OpenAI's API has and this gateway cannot honour (before the schema, whose message for
    an unknown field would not say why): a field above, a tool other than a function, an input item other than a
    message or a function call and its output."""
    for name, (default, why) in UNSUPPORTED_FIELDS.items():
        if name in data and data[name] is not None and data[name] != default:
            raise APIError(400, f"Unsupported parameter: '{name}': {why}.", "unsupported_parameter", param=name)
    tools = data.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise APIError(
                400,
                f"Unsupported tool type '{kind[:64]}' in 'tools.{i}': this gateway serves function tools only "
                "(built-in tools such as web_search or file_search are not available).",
                "unsupported_tool",
                param=f"tools.{i}.type",
            )
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("type"), str) and choice["type"] != "function":
        raise APIError(
            400,
            f"Unsupported tool_choice type '{choice['type'][:64]}': only 'none', 'auto', 'required' or a function.",
            "unsupported_tool",
            param="tool_choice.type",
        )
    items = data.get("input")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in ITEM_TYPES:
            raise APIError(
                400,
                f"Unsupported input item type '{kind[:64]}' in 'input.{i}': this gateway takes messages, "
                "function_call and function_call_output items.",
                "unsupported_input_item",
                param=f"input.{i}.type",
            )
