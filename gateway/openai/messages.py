"""The chat messages of a /v1/chat/completions request: content parts, the messages of each role, tool calls.

Built as gateway.openai.strict describes; the request bodies that hold them are in gateway.openai.schema.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, NotRequired, TypeAlias, Union

from pydantic import Discriminator, Field, Tag, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from tokenweir.gateway.openai.strict import STRICT, one_of

# Content parts. Known types are checked; any other part passes through to the upstream, which decides.
_PART_TYPES = ("text", "image_url", "input_audio", "file", "refusal")


@with_config(STRICT)
class TextPart(TypedDict):
    type: Literal["text"]
    text: str


@with_config(STRICT)
class ImageURL(TypedDict):
    url: Annotated[str, Field(description="An http(s) URL or a data: URL.")]
    detail: NotRequired[str | None]


if TYPE_CHECKING:  # what one_of builds at run time, spelled so the type checker can read it
    ImageURLValue: TypeAlias = ImageURL | str
else:
    ImageURLValue = one_of("an object with a string 'url', or a string", object=ImageURL, string=str)


@with_config(STRICT)
class ImagePart(TypedDict):
    type: Literal["image_url"]
    image_url: ImageURLValue


@with_config(STRICT)
class InputAudio(TypedDict):
    data: Annotated[str, Field(description="Base64-encoded audio.")]
    format: Annotated[str, Field(description="'wav', 'mp3', ...")]


@with_config(STRICT)
class AudioPart(TypedDict):
    type: Literal["input_audio"]
    input_audio: InputAudio


@with_config(STRICT)
class FileRef(TypedDict, total=False):
    file_data: str
    file_id: str
    filename: str


@with_config(STRICT)
class FilePart(TypedDict):
    type: Literal["file"]
    file: FileRef


@with_config(STRICT)
class RefusalPart(TypedDict):
    type: Literal["refusal"]
    refusal: str


@with_config(STRICT)
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
if TYPE_CHECKING:
    Content: TypeAlias = str | list[ContentPart]
else:
    Content = one_of(
        "a string or an array of content parts",
        string=str,
        array=Annotated[list[ContentPart], Field(min_length=1)],
    )


@with_config(STRICT)
class FunctionCall(TypedDict):
    name: str
    arguments: Annotated[str, Field(description="JSON text.")]


@with_config(STRICT)
class ToolCall(TypedDict):
    id: NotRequired[str]
    type: NotRequired[str]
    function: FunctionCall


@with_config(STRICT)
class SystemMessage(TypedDict):
    role: Literal["system"]
    content: Content
    name: NotRequired[str]


@with_config(STRICT)
class DeveloperMessage(TypedDict):
    role: Literal["developer"]
    content: Content
    name: NotRequired[str]


@with_config(STRICT)
class UserMessage(TypedDict):
    role: Literal["user"]
    content: Content
    name: NotRequired[str]


@with_config(STRICT)
class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: NotRequired[Content | None]
    name: NotRequired[str]
    refusal: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCall] | None]
    function_call: NotRequired[FunctionCall | None]
    audio: NotRequired[dict[str, Any] | None]


@with_config(STRICT)
class ToolMessage(TypedDict):
    role: Literal["tool"]
    content: NotRequired[Content | None]
    tool_call_id: NotRequired[str]


@with_config(STRICT)
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
    Discriminator(
        _role_tag,
        custom_error_type="invalid_message",
        custom_error_message="invalid message",
        custom_error_context={"expected": ", ".join(repr(role) for role in MESSAGE_ROLES)},  # the roles it may name
    ),
]
