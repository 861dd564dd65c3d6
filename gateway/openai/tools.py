"""What a /v1/chat/completions request says about tools and output: tool and function definitions, the tool
choice, and response_format.

Built as gateway.openai.strict describes; the request body that holds them is in gateway.openai.schema.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, NotRequired, TypeAlias, Union

from pydantic import Discriminator, Field, Tag, with_config
from pydantic.json_schema import SkipJsonSchema
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from tokenweir.gateway.openai.strict import STRICT, one_of

# Tools. A function's name is what OpenAI accepts (letters, digits, '_' and '-', at most 64); its parameters are a
# JSON Schema whose top level describes an object. Tool types other than 'function' pass through to the upstream.
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="[A-Za-z0-9_-]{1,64}")]


@with_config(STRICT)
class FunctionParameters(TypedDict, total=False):
    """A JSON Schema object; only its top level is checked (an object schema), the rest is the upstream's."""

    type: Literal["object"]
    properties: dict[str, Any]
    required: list[str]


@with_config(STRICT)
class FunctionDefinition(TypedDict):
    name: FunctionName
    description: NotRequired[str]
    parameters: NotRequired[Annotated[FunctionParameters, Field(description="A JSON Schema object.")]]
    strict: NotRequired[bool | None]


@with_config(STRICT)
class FunctionTool(TypedDict):
    type: Literal["function"]
    function: FunctionDefinition


@with_config(STRICT)
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


@with_config(STRICT)
class NamedFunction(TypedDict):
    name: FunctionName


@with_config(STRICT)
class NamedToolChoice(TypedDict):
    type: str
    function: NotRequired[NamedFunction]


# response_format: one of OpenAI's three types; json_schema carries a named schema.
@with_config(STRICT)
class JSONSchemaFormat(TypedDict):
    name: FunctionName
    description: NotRequired[str]
    schema: NotRequired[Annotated[dict[str, Any], Field(description="A JSON Schema object.")]]
    strict: NotRequired[bool | None]


@with_config(STRICT)
class TextFormat(TypedDict):
    type: Literal["text"]


@with_config(STRICT)
class JSONObjectFormat(TypedDict):
    type: Literal["json_object"]


@with_config(STRICT)
class JSONSchemaResponseFormat(TypedDict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


_FORMAT_TYPES = ("text", "json_object", "json_schema")


@with_config(STRICT)
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


if TYPE_CHECKING:  # what one_of builds at run time, spelled so the type checker can read it
    ToolChoice: TypeAlias = Literal["none", "auto", "required"] | NamedToolChoice
    FunctionCallChoice: TypeAlias = Literal["none", "auto"] | NamedFunction
else:
    ToolChoice = one_of(
        "a string ('none', 'auto' or 'required') or an object",
        string=Literal["none", "auto", "required"],
        object=NamedToolChoice,
    )
    FunctionCallChoice = one_of(
        "a string ('none' or 'auto') or an object with a 'name'", string=Literal["none", "auto"], object=NamedFunction
    )
