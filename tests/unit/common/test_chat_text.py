"""The chat text-part join: what the engine renders, the gateway counts and hashes, from one function."""

from __future__ import annotations

from tokenweir.common.text.chat_text import template_message
from tokenweir.gateway.openai.token_count import message_text

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}]},
    {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c1"},
    {"role": "user", "content": [], "name": "ann"},
]


def test_the_engine_renders_what_the_gateway_counts():
    from tokenweir.engine.api.protocol import ChatMessage

    for message in MESSAGES:
        engine_view = ChatMessage.model_validate(message).to_template()
        assert engine_view == template_message(message)
        assert message_text(message)[0] == engine_view["content"]


def test_text_parts_are_joined_with_newlines_and_missing_content_is_empty():
    assert template_message(MESSAGES[1]) == {"role": "user", "content": "first\nsecond"}
    assert template_message(MESSAGES[2])["content"] == ""
    assert template_message(MESSAGES[3]) == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert template_message(MESSAGES[4]) == {"role": "user", "content": "", "name": "ann"}
