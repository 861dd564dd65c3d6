"""Pydantic models of the OpenAI-compatible API's requests as vLLM accepts them (responses: engine/api/responses.py).

Unknown request fields are ignored (as vLLM does); known fields are validated, so a wrong value is a 400 that names
the field. Features the engine does not have (best_of > 1, suffix) are refused with a message instead of being
silently dropped; so is tool_choice "auto" where the engine runs without a tool-call parser (engine/api/routes.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tokenweir.common.text.chat_text import template_message
from tokenweir.engine.sched.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(BaseModel):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text" or self.text is None:
            raise ValueError(f"only text content parts are supported by this model, got type {self.type!r}")
        return self


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict:
        """The dict a chat template expects (common/text/chat_text.py: text parts joined as the gateway counts them)."""
        return template_message(self.model_dump(exclude_none=True))


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
        return self


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def parameters_schema(self) -> dict:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class _SamplingRequest(BaseModel):
    """Fields shared by chat and text completions (OpenAI's plus vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    # tokenweir extra: false keeps this request out of speculative decoding where the engine runs it
    speculative: bool = True
    # vLLM's disaggregated prefill: {"do_remote_decode": true} on a prefill hop (its response answers where the
    # prompt's KV waits), that answer on the decode hop
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: the prefix cache is shared only among requests with the same salt (the gateway sets it per team)
    cache_salt: str | None = Field(default=None, min_length=1)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids (strings of digits), got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self) -> SamplingParams:
        """The request's SamplingParams; max_tokens None = the rest of the context. Never fails for a validated request:
        the Field bounds above are the ones SamplingParams checks (its checks guard offline callers)."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=self.requested_max_tokens(),
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            n=self.n,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            speculative=self.speculative,
            kv_transfer_params=self.kv_transfer_params,
            cache_salt=self.cache_salt,
            **self.extra_sampling(),
        )

    def extra_sampling(self) -> dict:
        """SamplingParams fields of one endpoint (logprobs, structured output)."""
        return {}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


_UNSUPPORTED = {
    "audio": "audio output is not supported by this model",
    "prediction": "predicted outputs are not supported by this engine",
    "functions": "the legacy 'functions' field is not supported: send 'tools'",
    "function_call": "the legacy 'function_call' field is not supported: send 'tool_choice'",
    "reasoning_effort": "this model does not reason: leave reasoning_effort out",
    "web_search_options": "web search is not supported by this engine",
}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, validate_default=True
    )
    parallel_tool_calls: bool | None = None
    # Fields that would change the answer and that this engine cannot honour: a 400 naming the field, not silence.
    audio: dict | None = None
    modalities: list[str] | None = None
    prediction: dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    reasoning_effort: str | None = None
    web_search_options: dict | None = None

    @field_validator("modalities")
    @classmethod
    def _text_out(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and set(value) - {"text"}:
            raise ValueError("this model answers in text only: send modalities ['text'] or leave it out")
        return value

    @field_validator("audio", "prediction", "functions", "function_call", "reasoning_effort", "web_search_options")
    @classmethod
    def _unhonoured(cls, value, info: ValidationInfo):
        if value is not None:
            assert info.field_name is not None  # set for a field validator
            raise ValueError(f"unsupported field '{info.field_name}': {_UNSUPPORTED[info.field_name]}")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: set logprobs to true")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice, info: ValidationInfo):
        """Checked as a field (after `tools` and `response_format`, declared above it) so a refusal names it."""
        tools, response_format = info.data.get("tools"), info.data.get("response_format")
        if not tools:
            if choice not in (None, "none"):
                raise ValueError("tool_choice needs tools: send the functions the model may call")
            return choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        if response_format is not None and response_format.type != "text" and choice != "none":
            raise ValueError("send either a tool_choice or a response_format, not both")
        return choice

    def requested_max_tokens(self) -> int | None:
        # OpenAI deprecated max_tokens for chat in favour of max_completion_tokens; the newer field wins.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.to_template() for m in self.messages]

    @property
    def tool_mode(self) -> Literal["named", "required", "auto"] | None:
        """How the output becomes tool calls: one named function's arguments, a list of calls, or text with calls
        the model chooses (absent means "auto" when tools are sent, as OpenAI has it); None: text."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice in (None, "auto"):
            return "auto"
        return "required" if self.tool_choice == "required" else "named"

    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat template and the tool-call grammar read them; None without tools or with "none"."""
        if not self.tools or self.tool_mode is None:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def structured_spec(self) -> dict | None:
        """The response_format the output must follow: the client's, or the JSON schema of the tool call(s) asked
        for (vLLM's way of answering a forced tool choice without a tool-call parser). Calls the model chooses
        ("auto") follow their parser's grammar instead, which the route sets (engine/api/routes.py)."""
        if self.tool_mode == "named":
            assert self.tools is not None and isinstance(self.tool_choice, NamedToolChoice)  # what "named" means
            tool = next(t for t in self.tools if t.function.name == self.tool_choice.function.name)
            return _json_schema(tool.function.name, tool.function.parameters_schema())
        if self.tool_mode == "required":
            assert self.tools is not None  # a tool mode implies tools
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": t.function.parameters_schema(),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            one = {"maxItems": 1} if self.parallel_tool_calls is False else {}
            return _json_schema("tool_calls", {"type": "array", "minItems": 1, **one, "items": {"anyOf": calls}})
        if self.response_format is None or self.response_format.type == "text":
            return None
        return self.response_format.model_dump(exclude_none=True, by_alias=True)

    def extra_sampling(self) -> dict:
        return {
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "structured": self.structured_spec(),
        }


def _json_schema(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("the prompt is empty")
            if isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise ValueError(f"send one prompt per request (got a batch of {len(prompt)})")
                prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    def extra_sampling(self) -> dict:
        return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None}

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only best_of=1 is supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (fill-in-the-middle) is not supported by this engine")
        return value


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class AbortRequest(BaseModel):
    request_id: str = Field(min_length=1)
