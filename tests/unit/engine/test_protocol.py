"""What a chat request asks the engine to constrain: the response_format, or the JSON schema of the tool calls."""

import jsonschema
import pytest
from pydantic import ValidationError

from tokenweir.engine.api.protocol import ChatCompletionRequest

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"function": {"name": "noop"}},
]
ASK = [{"role": "user", "content": "hi"}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=ASK, **fields)


def test_a_named_tool_constrains_to_its_parameters():
    spec = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}).structured_spec()
    assert spec["json_schema"]["schema"] == WEATHER
    noop = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "noop"}}).structured_spec()
    assert noop["json_schema"]["schema"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_is_a_list_of_calls_one_when_parallel_calls_are_off(parallel):
    schema = request(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel).structured_spec()
    schema = schema["json_schema"]["schema"]
    two = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "noop", "parameters": {}}]
    jsonschema.validate(two[:1], schema)
    if parallel is False:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    else:
        jsonschema.validate(two, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)  # its required city
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


def test_response_format_and_none_choice():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": WEATHER}}
    assert request(response_format=fmt).structured_spec()["json_schema"]["schema"] == WEATHER
    assert request(response_format={"type": "text"}).structured_spec() is None
    assert request(tools=TOOLS, tool_choice="none").structured_spec() is None
    assert request(tools=TOOLS, tool_choice="none").tool_mode is None
    assert request(tools=TOOLS, tool_choice="none").tool_dicts() is None


def test_tools_without_a_choice_are_calls_the_model_chooses():
    for chosen in (request(tools=TOOLS), request(tools=TOOLS, tool_choice="auto")):
        assert chosen.tool_mode == "auto" and chosen.structured_spec() is None  # the parser's grammar, set later
        assert [t["function"]["name"] for t in chosen.tool_dicts()] == [t["function"]["name"] for t in TOOLS]


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),  # "auto" and a format
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_contradictions_are_refused_naming_the_field(fields, named):
    with pytest.raises(ValidationError) as info:
        request(**fields)
    assert info.value.errors()[0]["loc"] == (named,)
