"""The Responses API's translation to chat and back (gateway/openai/responses_*.py), and what a pool that serves
/v1/responses is passed and billed from (gateway/request/response_events.py): pure functions, real inputs."""

from __future__ import annotations

import itertools

import orjson
import pytest
from openai.types.responses import Response

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.openai.body import check_body
from tokenweir.gateway.openai.responses_input import chat_body, chat_messages, input_items, passthrough_body
from tokenweir.gateway.openai.responses_output import envelope, from_chat, passed_through
from tokenweir.gateway.openai.responses_schema import RESPONSES, check_supported
from tokenweir.gateway.openai.responses_stream import ResponseEvents
from tokenweir.gateway.request.response_events import ResponseEventFilter


def ids():
    counter = itertools.count()
    return lambda prefix: f"{prefix}_{next(counter)}"


def checked(body: dict) -> dict:
    check_supported(body)
    return check_body(body, orjson.dumps(body), RESPONSES)


def translate(body: dict) -> dict:
    body = checked(body)
    return chat_body(body, input_items(body, ids()))


def test_a_string_input_with_instructions_is_a_system_then_a_user_message():
    chat = translate({"model": "m", "input": "hello", "instructions": "be brief", "max_output_tokens": 7})
    assert chat == {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        "max_tokens": 7,
    }


def test_items_become_messages_tool_calls_and_tool_results_in_order():
    body = {
        "model": "m",
        "input": [
            {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"type": "message", "role": "user", "content": "weather?"},
            {"role": "assistant", "content": "checking"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        ],
    }
    assert translate(body)["messages"] == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "checking",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    ]


def test_tools_tool_choice_format_and_sampling_take_chats_names():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    chat = translate(
        {
            "model": "m",
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "description": "d", "parameters": schema, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
            "temperature": 0.5,
            "top_p": 0.9,
            "user": "u1",
            "metadata": {"k": "v"},
            "stream": True,
        }
    )
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": schema, "strict": True}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": True},
    }
    assert (chat["parallel_tool_calls"], chat["temperature"], chat["top_p"], chat["user"]) == (False, 0.5, 0.9, "u1")
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert "metadata" not in chat and "store" not in chat  # the response's own, not the upstream's


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", "unsupported_tool"),
        ({"model": "m", "input": "x", "reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
        ({"model": "m", "input": "x", "frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"model": "m", "input": [{"type": "reasoning", "summary": []}]}, "input.0.type", "unsupported_input_item"),
        ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input.0.role", "invalid_value"),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.name", None),
        ({"model": "m"}, "input", "missing_required_parameter"),
        ({"model": "m", "input": []}, "input", "invalid_value"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(body, param, code):
    with pytest.raises(APIError) as err:
        translate(body)
    assert err.value.status == 400 and err.value.param == param
    if code is not None:
        assert err.value.code == code


def test_a_chat_answer_becomes_a_response_the_sdk_reads():
    body = checked({"model": "m", "input": "hi", "instructions": "x", "metadata": {"a": "b"}})
    chat = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "let me see",
                    "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
            }
        ],
        "usage": {"prompt_tokens": 11, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 3}},
    }
    response = Response.model_validate(from_chat(chat, envelope(body, "resp_1", 1700000000), ids()))
    assert response.status == "completed" and response.output_text == "let me see"
    assert [item.type for item in response.output] == ["message", "function_call"]
    call = response.output[1]
    assert (call.call_id, call.name, call.arguments) == ("call_9", "f", "{}")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (11, 4, 15)
    assert usage.input_tokens_details.cached_tokens == 3 and usage.output_tokens_details.reasoning_tokens == 0
    assert (response.instructions, response.metadata, response.store) == ("x", {"a": "b"}, True)


def test_a_chat_cut_by_length_is_an_incomplete_response():
    body = checked({"model": "m", "input": "hi", "max_output_tokens": 2})
    chat = {"choices": [{"index": 0, "finish_reason": "length", "message": {"content": "a b"}}]}
    response = Response.model_validate(from_chat(chat, envelope(body, "resp_1", 0), ids()))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage is None


def sse(*chunks) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def parse(stream: bytes) -> list[dict]:
    events = []
    for frame in stream.split(b"\n\n"):
        if frame:
            name, data = frame.split(b"\n")
            event = orjson.loads(data.removeprefix(b"data: "))
            assert name == b"event: " + event["type"].encode()
            events.append(event)
    return events


def test_a_chat_stream_becomes_responses_events_in_openais_order():
    body = checked({"model": "m", "input": "hi", "stream": True})
    events = ResponseEvents(envelope(body, "resp_1", 0), ids())
    text = [{"choices": [{"index": 0, "delta": {"content": piece}}]} for piece in ("Hel", "lo")]
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    more = {"index": 0, "function": {"arguments": ": 1}"}}
    written = (
        events.start()
        + events.feed(sse(*text))
        + events.feed(
            sse(
                {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]},
                {"choices": [{"index": 0, "delta": {"tool_calls": [more]}, "finish_reason": "tool_calls"}]},
                {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}},
            )
        )
    )
    written += events.end()
    got = parse(written)
    assert [e["type"] for e in got] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    final = Response.model_validate(got[-1]["response"])
    assert final.output_text == "Hello" and final.output[1].arguments == '{"a": 1}'
    assert final.usage.total_tokens == 9 and final.status == "completed"
    assert got[-1]["response"] == events.final


def test_a_stream_that_broke_off_ends_failed():
    body = checked({"model": "m", "input": "hi", "stream": True})
    events = ResponseEvents(envelope(body, "resp_1", 0), ids())
    broken = sse(
        {"choices": [{"index": 0, "delta": {"content": "x"}}]},
        {"error": {"message": "gone", "code": "upstream_broken"}},
    )
    got = parse(events.start() + events.feed(broken) + events.end())
    assert got[-1]["type"] == "response.failed"
    assert got[-1]["response"]["error"] == {"code": "upstream_broken", "message": "gone"}


def test_an_earlier_output_item_of_another_kind_has_no_chat_turn():
    items = [
        {"id": "rs_1", "type": "reasoning", "summary": []},
        {"id": "m1", "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
    ]
    assert chat_messages(None, items) == [{"role": "assistant", "content": "hi"}]


def test_a_request_passed_through_carries_its_earlier_turns_without_our_ids_or_store():
    body = checked({"model": "m", "input": "next", "previous_response_id": "resp_1", "store": True, "priority": 2})
    earlier = [{"id": "msg_0", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]}]
    sent = passthrough_body(body, earlier + input_items(body, ids()))
    assert sent == {
        "model": "m",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "next"}]},
        ],
        "store": False,
    }


def test_a_passed_through_stream_is_forwarded_and_billed_from_its_terminal_event():
    ticks = itertools.count(1.0)
    chunks = ResponseEventFilter(False, False, True, lambda: next(ticks))
    usage = {"input_tokens": 7, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 3}}
    done = {
        "type": "response.incomplete",
        "response": {"usage": usage, "incomplete_details": {"reason": "max_output_tokens"}},
    }
    out = [
        chunks.process(orjson.dumps(e))
        for e in (
            {"type": "response.created", "response": {}},
            {"type": "response.output_text.delta", "delta": "x"},
            done,
        )
    ]
    assert out[1] == b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"x"}\n\n'
    assert (chunks.first_token_at, chunks.text, chunks.done, chunks.finish_reason) == (1.0, ["x"], True, "length")
    assert chunks.usage == {
        "prompt_tokens": 7,
        "completion_tokens": 2,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_a_passed_through_response_is_made_this_gateways():
    body = checked({"model": "public", "input": "x", "previous_response_id": "resp_0", "metadata": {"k": "v"}})
    theirs = {"id": "resp_theirs", "object": "response", "model": "gpt-x", "store": False, "status": "completed"}
    ours = passed_through(theirs, envelope(body, "resp_ours", 5))
    assert ours == {
        "id": "resp_ours",
        "object": "response",
        "created_at": 5,
        "model": "public",
        "previous_response_id": "resp_0",
        "store": True,
        "metadata": {"k": "v"},
        "status": "completed",
    }
