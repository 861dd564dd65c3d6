"""The /v1 request schemas: what /v1/chat/completions and /v1/completions accept, as strict pydantic TypedDicts.

`CHAT` and `COMPLETION` are the TypeAdapters the routes validate with (see gateway.openai.body) and publish in the
OpenAPI document. Strict mode: "100" is not an integer, "false" is not a boolean, 1.5 is not an integer (numbers may be
written as integers, as OpenAI accepts). Unknown fields pass through untouched (extra="allow").

The parts live beside it: chat messages in gateway.openai.messages, tools and response_format in
gateway.openai.tools, the strict building blocks in gateway.openai.strict.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, Required, TypeAlias, Union

from pydantic import Discriminator, Field, Tag, TypeAdapter, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from tokenweir.gateway.openai.messages import ChatMessage
from tokenweir.gateway.openai.strict import STRICT, between, one_of
from tokenweir.gateway.openai.tools import FunctionCallChoice, FunctionDefinition, ResponseFormat, Tool, ToolChoice

MAX_TOKENS = 2**31 - 1  # max_tokens and token ids: beyond any context window, within every store and engine
_INT64 = 2**63


@with_config(STRICT)
class StreamOptions(TypedDict, total=False):
    include_usage: bool | None
    continuous_usage_stats: bool | None
    include_obfuscation: bool | None


if TYPE_CHECKING:  # what one_of builds at run time, spelled so the type checker can read it
    Stop: TypeAlias = str | list[str]
else:
    Stop = one_of("a string or an array of strings", string=str, array=list[str])
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
MaxTokens = Annotated[int, between(1, MAX_TOKENS)]
Penalty = Annotated[float, between(-2, 2)]
Priority = Annotated[
    int, between(0, 2, "tokenweir: 0 critical, 1 standard, 2 batch; a request may lower its team's, never raise it.")
]
# Candidates generated server-side per prompt (the upstream bills every one), of which n are returned. Typed on chat
# too: vLLM's chat endpoint takes it, and an untyped value would reach the reservation unchecked.
BestOf = Annotated[int, between(0, 20, "Candidates generated per prompt; output is reserved for them all.")]
# vLLM's: narrows the prefix cache the request may share; mixed into the gateway's salt of the pool's cache_scope
# (gateway/request/cache_scope.py), never replacing it
CacheSalt = Annotated[str, Field(min_length=1, description="Shares cached prompt prefixes only with this salt's.")]


@with_config(STRICT)
class _Body(TypedDict, total=False):
    """What /v1/chat/completions and /v1/completions share. Unknown fields pass through to the upstream."""

    model: Required[Annotated[str, Field(min_length=1)]]
    max_tokens: MaxTokens | None
    temperature: Annotated[float, between(0, 2)] | None
    top_p: Annotated[float, between(0, 1)] | None
    n: Annotated[int, between(1, 128, "Choices per prompt; output is reserved for n x max_tokens.")] | None
    best_of: BestOf | None
    echo: bool | None
    stream: bool | None
    stream_options: StreamOptions | None
    stop: Stop | None
    user: str | None
    seed: Annotated[int, between(-_INT64, _INT64 - 1)] | None
    presence_penalty: Penalty | None
    frequency_penalty: Penalty | None
    logit_bias: LogitBias | None
    priority: Priority
    cache_salt: CacheSalt | None


@with_config(STRICT)
class ChatCompletionRequest(_Body, total=False):
    messages: Required[Annotated[list[ChatMessage], Field(min_length=1)]]
    max_completion_tokens: MaxTokens | None
    logprobs: bool | None
    top_logprobs: Annotated[int, between(0, 20)] | None
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


@with_config(STRICT)
class CompletionRequest(_Body, total=False):
    prompt: Required[Prompt]
    logprobs: Annotated[int, between(0, 20)] | None
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


@with_config(STRICT)
class EmbeddingRequest(TypedDict, total=False):
    """/v1/embeddings. Unknown fields pass through to the upstream."""

    model: Required[Annotated[str, Field(min_length=1)]]
    input: Required[EmbeddingInput]
    encoding_format: Literal["float", "base64"] | None
    dimensions: Annotated[int, between(1, 65536)] | None
    user: str | None
    priority: Priority


EMBEDDING = TypeAdapter(EmbeddingRequest)
