"""The Responses API (/v1/responses) through the real `openai` SDK against the gateway under uvicorn, in front of the
fake upstream, with the store on SQLite and on PostgreSQL: each response is a chat upstream, billed as one, answered
and stored in the Responses API's shape, and its team's alone."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from tests.support.events import the_event
from tests.support.responses import MODEL, TeamClients, responses_stack

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def stack(request, tmp_path_factory):
    with responses_stack(request.param, tmp_path_factory.mktemp(f"responses-{request.param}")) as made:
        yield made


@pytest.fixture
async def team_client(stack):
    clients = TeamClients(stack)
    yield clients
    await clients.close()


def last_chat(stack) -> dict:
    path, body = stack["fake"].received[-1]
    assert path == "/v1/chat/completions"  # the upstream is sent a chat, whatever the client called
    return body


async def test_a_string_input_is_answered_as_a_response_and_billed_as_its_usage(stack, team_client):
    client = team_client()
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input="Say hello to the gateway", instructions="Be brief.", max_output_tokens=50
    )
    response = raw.parse()
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == "tok " * 16  # the fake stops by itself at 16 tokens, within the 50 asked
    assert response.output[0].type == "message" and response.output[0].content[0].annotations == []
    assert response.instructions == "Be brief." and response.max_output_tokens == 50 and response.store is True
    sent = last_chat(stack)
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello to the gateway"},
    ]
    assert sent["max_tokens"] == 50
    event = the_event(stack["events"], raw.headers["x-request-id"])
    assert (event["kind"], event["status"], event["stream"]) == ("responses", "ok", False)
    usage = response.usage
    assert (event["prompt_tokens"], event["completion_tokens"]) == (usage.input_tokens, usage.output_tokens)
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (9, 16, 25)  # fake: 2 + 7 words


async def test_a_message_list_and_a_length_cut_make_an_incomplete_response(stack, team_client):
    client = team_client()
    response = await client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "input_text", "text": "one two"}]},
        ],
        max_output_tokens=3,
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "tok " * 3
    assert last_chat(stack)["messages"] == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "one two"},
    ]


async def test_a_stream_sends_openais_events_in_order_and_is_stored_as_it_ended(stack, team_client):
    client = team_client()
    async with client.responses.stream(model=MODEL, input="stream it", max_output_tokens=3) as stream:
        events = [event async for event in stream]
    kinds = [event.type for event in events]
    # OpenAI ends a stream cut at max_output_tokens with response.incomplete (whose response the SDK's
    # get_final_response does not take yet: openai-python#3538), so the last event's response is the final one
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # cut at max_output_tokens, as OpenAI ends such a stream
    ]
    assert final.output_text == "tok " * 3 and final.usage.output_tokens == 3
    stored = await client.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.usage == final.usage
    assert last_chat(stack)["stream_options"]["include_usage"] is True


async def test_a_raw_stream_numbers_its_events_and_bills_what_it_reports(stack, team_client):
    client = team_client()
    auth = {"authorization": f"Bearer {client.api_key}"}
    body = {"model": MODEL, "input": "a b", "stream": True}
    async with (
        httpx.AsyncClient(base_url=stack["url"], headers=auth) as http,
        http.stream("POST", "/v1/responses", json=body) as r,
    ):
        assert r.headers["content-type"].startswith("text/event-stream")
        written = b"".join([chunk async for chunk in r.aiter_bytes()])
        request_id = r.headers["x-request-id"]
    events = [orjson.loads(line[6:]) for line in written.split(b"\n") if line.startswith(b"data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "completed"
    usage = events[-1]["response"]["usage"]
    event = the_event(stack["events"], request_id)
    assert (event["kind"], event["stream"], event["status"]) == ("responses", True, "ok")
    assert (event["prompt_tokens"], event["completion_tokens"]) == (usage["input_tokens"], usage["output_tokens"])


async def test_three_turns_carry_every_earlier_turn_to_the_upstream(stack, team_client):
    client = team_client()
    first = await client.responses.create(model=MODEL, input="first question", instructions="sys", max_output_tokens=2)
    second = await client.responses.create(
        model=MODEL, input="second question", previous_response_id=first.id, max_output_tokens=2
    )
    third = await client.responses.create(
        model=MODEL, input="third question", previous_response_id=second.id, max_output_tokens=2
    )
    assert third.previous_response_id == second.id
    assert last_chat(stack)["messages"] == [  # instructions are not carried over (as OpenAI)
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "tok tok "},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "tok tok "},
        {"role": "user", "content": "third question"},
    ]
    items = await client.responses.input_items.list(third.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [("message", r) for r in ("user", "assistant") * 2 + ("user",)]
    assert items.data[1].id == first.output[0].id  # the earlier output item, as it was answered


async def test_input_items_list_pages_and_delete_removes_the_response(stack, team_client):
    client = team_client()
    turns = [{"role": "user", "content": f"turn {i}"} for i in range(5)]
    response = await client.responses.create(model=MODEL, input=turns, max_output_tokens=1)
    newest = await client.responses.input_items.list(response.id, limit=2)
    assert [i.content[0].text for i in newest.data] == ["turn 4", "turn 3"] and newest.has_more
    rest = await client.responses.input_items.list(response.id, limit=10, after=newest.last_id)
    assert [i.content[0].text for i in rest.data] == ["turn 2", "turn 1", "turn 0"] and not rest.has_more
    assert (rest.first_id, rest.last_id) == (rest.data[0].id, rest.data[-1].id)
    deleted = await client.responses.with_raw_response.delete(response.id)
    assert orjson.loads(deleted.content) == {"id": response.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(response.id)


async def test_text_format_json_schema_is_the_upstreams_response_format(stack, team_client):
    client = team_client()
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    response = await client.responses.create(model=MODEL, input="json please", text={"format": fmt})
    assert last_chat(stack)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }
    assert response.text.format.type == "json_schema" and response.text.format.name == "answer"


async def test_a_function_call_and_its_output_make_the_next_turn(stack, team_client):
    client = team_client()
    call_turn = await client.responses.create(
        model=MODEL, input="weather in Oslo?", tools=[WEATHER], tool_choice="required"
    )
    assert last_chat(stack)["tools"] == [
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    ]
    (call,) = call_turn.output
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", '{"tok": "tok"}')
    assert call.id.startswith("fc_") and call.call_id
    answer = await client.responses.create(
        model=MODEL,
        previous_response_id=call_turn.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rainy"}],
        tools=[WEATHER],
    )
    assert answer.status == "completed" and answer.output_text
    assert last_chat(stack)["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "rainy"},
    ]


async def test_a_streamed_function_call_sends_its_argument_events(stack, team_client):
    client = team_client()
    async with client.responses.stream(model=MODEL, input="call it", tools=[WEATHER], tool_choice="required") as s:
        kinds = [event.type async for event in s]
        final = await s.get_final_response()
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.output[0].arguments == '{"tok": "tok"}' and final.output[0].name == "get_weather"


async def test_another_teams_response_is_not_found_everywhere(stack, team_client):
    owner, stranger = team_client(), team_client()
    response = await owner.responses.create(model=MODEL, input="mine", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError) as missing:
        await stranger.responses.retrieve("resp_doesnotexist")
    for call in (
        stranger.responses.retrieve(response.id),
        stranger.responses.delete(response.id),
        stranger.responses.input_items.list(response.id),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            await call
        assert err.value.message.replace(response.id, "X") == missing.value.message.replace("resp_doesnotexist", "X")
    with pytest.raises(openai.NotFoundError) as err:
        await stranger.responses.create(model=MODEL, input="yours?", previous_response_id=response.id)
    assert err.value.param == "previous_response_id" and err.value.code == "previous_response_not_found"
    assert (await owner.responses.retrieve(response.id)).id == response.id  # still there for its team


async def test_a_response_made_with_store_false_is_not_kept(stack, team_client):
    client = team_client()
    response = await client.responses.create(model=MODEL, input="forget me", store=False, max_output_tokens=1)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "unsupported_tool"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
        ({"temperature": 3}, "temperature", "invalid_value"),
        ({"input": [{"role": "user", "content": 5}]}, "input.0.content", "invalid_type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type", "unsupported_input_item"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field_and_its_event_says_responses(stack, team_client, extra, param, code):
    client = team_client()
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(**{"model": MODEL, "input": "x", **extra})
    assert (err.value.param, err.value.code) == (param, code)
    event = the_event(stack["events"], err.value.response.headers["x-request-id"])
    assert (event["kind"], event["status"], event["http_status"]) == ("responses", "rejected", 400)


async def test_a_client_that_leaves_mid_stream_stops_the_upstream_and_is_billed_what_was_made(stack, team_client):
    client = team_client()
    stack["fake"].itl_ms = 50  # 16 tokens over ~0.8 s: time to leave in the middle
    try:
        auth = {"authorization": f"Bearer {client.api_key}"}
        async with (
            httpx.AsyncClient(base_url=stack["url"], headers=auth) as http,
            http.stream("POST", "/v1/responses", json={"model": MODEL, "input": "slow", "stream": True}) as r,
        ):
            request_id = r.headers["x-request-id"]
            async for line in r.aiter_lines():
                if "response.output_text.delta" in line:
                    break  # a first token came: leave
    finally:
        stack["fake"].itl_ms = 0
    event = the_event(stack["events"], request_id)
    assert (event["kind"], event["status"], event["reason"]) == ("responses", "cancelled", "client_disconnected")
    record = stack["fake"].records[event["upstream_request_id"]]
    assert record.status == "aborted" and 0 < record.completion_tokens < 16  # stopped there, not run on
    assert (event["prompt_tokens"], event["completion_tokens"]) == (record.prompt_tokens, record.completion_tokens)
