"""A pool whose members serve /v1/responses themselves (`serves_responses`): the request passed through as the client
sent it (its earlier turns written into its input, nothing for the upstream to store), the upstream's own response and
events made this gateway's, billed from its usage and stored here; the option set in the config or the admin API."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.events import the_event
from tests.support.responses import EXTERNAL, MODEL, TeamClients, responses_stack


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def stack(request, tmp_path_factory):
    with responses_stack(request.param, tmp_path_factory.mktemp(f"responses-{request.param}")) as made:
        yield made


@pytest.fixture
async def team_client(stack):
    clients = TeamClients(stack)
    yield clients
    await clients.close()


def last_passed_through(stack) -> dict:
    path, body = stack["fake"].received[-1]
    assert path == "/v1/responses"  # a pool that serves the Responses API gets it as it is
    return body


async def test_a_pool_that_serves_responses_gets_the_request_itself_and_bills_its_usage(stack, team_client):
    client = team_client()
    first = await client.responses.create(model=EXTERNAL, input="one two three", instructions="sys")
    raw = await client.responses.with_raw_response.create(
        model=EXTERNAL, input="four", previous_response_id=first.id, max_output_tokens=5, metadata={"k": "v"}
    )
    second = raw.parse()
    sent, said = last_passed_through(stack), "tok " * 16
    assert first.output_text == said
    assert sent["input"] == [  # the earlier turn written in, without our ids; nothing for it to store or look up
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "one two three"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": said, "annotations": []}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "four"}]},
    ]
    assert sent["store"] is False and "previous_response_id" not in sent and sent["max_output_tokens"] == 5
    assert second.id.startswith("resp_") and not second.id.startswith("resp_fake")  # ours, not the upstream's
    assert (second.model, second.previous_response_id, second.metadata) == (EXTERNAL, first.id, {"k": "v"})
    assert second.status == "incomplete" and second.output_text == "tok " * 5
    event = the_event(stack["events"], raw.headers["x-request-id"])
    assert (event["kind"], event["status"], event["model"]) == ("responses", "ok", EXTERNAL)
    assert (event["prompt_tokens"], event["completion_tokens"]) == (second.usage.input_tokens, 5)
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text


async def test_a_stream_passed_through_keeps_the_upstreams_events_and_is_billed_and_kept(stack, team_client):
    client = team_client()
    async with client.responses.stream(model=EXTERNAL, input="stream this please") as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert [e.type for e in events].count("response.output_text.delta") == 16 and events[
        -1
    ].type == "response.completed"
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}  # ours throughout
    assert final.output_text == "tok " * 16 and final.usage.output_tokens == 16
    assert "stream_options" not in last_passed_through(stack)
    assert (await client.responses.retrieve(final.id)).usage == final.usage


async def test_the_admin_api_sets_serves_responses_on_a_pool_and_refuses_it_for_engines(stack, team_client):
    admin, _ = stack["store"].create_key(None, f"admin-{time.monotonic_ns()}", is_admin=True)
    member = {"base_url": stack["upstream_url"], "model": MODEL}
    async with httpx.AsyncClient(base_url=stack["url"], headers={"authorization": f"Bearer {admin}"}) as http:
        engines = {"model": "rt-engines", "upstreams": [member], "serves_responses": True}
        refused = await http.put("/admin/pools/rt-engines", json=engines)
        assert refused.status_code == 400 and "serves_responses" in refused.json()["error"]["message"]
        external = {"model": "rt-external", "upstreams": [{**member, "engine": False}], "serves_responses": True}
        put = await http.put("/admin/pools/rt-external", json=external)
        assert put.status_code == 200, put.text
        assert (await http.get("/admin/pools/rt-external")).json()["config"]["serves_responses"] is True
        client = team_client()
        response = await client.responses.create(model="rt-external", input="set at run time", max_output_tokens=2)
        assert last_passed_through(stack)["input"][0]["content"][0]["text"] == "set at run time"
        assert response.output_text == "tok tok "
        assert (await http.delete("/admin/pools/rt-external")).status_code == 200
