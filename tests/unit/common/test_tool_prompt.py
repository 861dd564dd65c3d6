"""How tools and earlier tool turns reach the prompt: through the template where it renders them, else in the
parser's format; and which templates render them, read from the template's syntax tree."""

import json

import pytest

from tokenweir.common.text.chat_template import template_reads
from tokenweir.common.text.tool_prompt import tool_conversation

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": "rain", "tool_call_id": "call_2"},
    {"role": "user", "content": "Thanks"},
]


def test_which_templates_render_tools_is_read_from_their_syntax():
    assert template_reads("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}", "tools")
    assert not template_reads("{# tools are not rendered #}{{ 'tools' }}{{ messages }}", "tools")
    assert not template_reads("{% set tools = [] %}{{ tools }}", "tools"), "a variable it sets is not an input"


def test_hermes_puts_tools_in_the_system_turn_and_earlier_calls_and_results_in_its_tags():
    messages, tools = tool_conversation(TURNS, TOOLS, "hermes", template_takes_tools=False)
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n") and json.dumps(TOOLS[0]) in system and "<tool_call>" in system
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    assert messages[2]["content"] == call + "\n" + call  # compact: as the grammar makes the model write them
    assert messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in messages)


def test_llama3_json_writes_calls_as_json_joined_by_semicolons_and_a_system_turn_when_none_is_sent():
    messages, _ = tool_conversation(TURNS[1:], TOOLS, "llama3_json", template_takes_tools=False)
    assert messages[0]["role"] == "system" and '"parameters"' in messages[0]["content"]
    call = '{"name":"get_weather","parameters":{"city":"Paris"}}'
    assert messages[2]["content"] == f"{call}; {call}"
    assert messages[3] == {"role": "user", "content": "sunny\nrain"}


def test_a_template_that_renders_tools_gets_them_with_argument_objects():
    messages, tools = tool_conversation(TURNS, TOOLS, "hermes", template_takes_tools=True)
    assert tools == TOOLS and [m["role"] for m in messages] == [m["role"] for m in TURNS]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert TURNS[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}', "the request is not changed"


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_without_tools_or_tool_turns_the_conversation_is_unchanged(fmt):
    plain = [{"role": "user", "content": "hi", "name": "bob"}]
    assert tool_conversation(plain, None, fmt, template_takes_tools=False) == (plain, None)
