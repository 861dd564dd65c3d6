"""The OpenAI surface teams use, through the `openai` SDK, against the gateway served by uvicorn in front of the fake
upstream over real HTTP: n choices (reserved n x max_tokens, billed as served), fields the gateway does not need
passed through untouched, /v1/embeddings (counted, admitted, billed), /v1/models with retrieve and max_model_len,
and strict shapes for tools, response_format, logit_bias and friends.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time

import openai
import pytest

from loadtests.fake_upstream import FakeUpstream, embedding_vector
from tests.support.events import the_event
from tests.support.serve_thread import ServerThread, serve_app
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.openai.token_count import TokenCounter
from tokenweir.gateway.request import stream_chunks
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

UPSTREAM_MODEL = "fake-model"
EXTERNAL = "ext-model"  # an external OpenAI-compatible pool, context length from its config
ENGINE = "eng-model"  # the fake as if it were our engine: its context length comes from its own /v1/models
NO_EMBEDDINGS = "chat-only"  # external, but configured `embeddings: false`
UNSIZED = "unsized-model"  # external, no max_context: no length to report
HELLO = [{"role": "user", "content": "Say hello to the gateway"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("surface")
    fake = FakeUpstream(model=UPSTREAM_MODEL, max_model_len=2048)
    store = Store.open(f"sqlite:///{tmp}/store.db")
    with ServerThread(fake) as upstream:

        def external(**kw) -> list[UpstreamConfig]:
            return [UpstreamConfig(upstream.url, model=UPSTREAM_MODEL, engine=False, **kw)]

        config = GatewayConfig(
            port=0,
            pools=[
                PoolConfig(model=EXTERNAL, upstreams=external(), max_context=8192),
                PoolConfig(model=ENGINE, upstreams=[UpstreamConfig(upstream.url, model=UPSTREAM_MODEL)]),
                PoolConfig(model=NO_EMBEDDINGS, upstreams=external(), embeddings=False),
                PoolConfig(model=UNSIZED, upstreams=external()),
            ],
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
            load_poll_interval_s=0.1,
        )
        with serve_app(config, store=store) as gw:
            yield {"fake": fake, "store": store, "url": gw.url, "events": tmp / "events.jsonl"}
    store.close()


def team_client(stack, limits: TeamLimits = TeamLimits()):
    team = stack["store"].create_team(f"team-{time.monotonic_ns()}", limits)
    secret, _ = stack["store"].create_key(team.id, "test")
    return team, openai.AsyncOpenAI(base_url=stack["url"] + "/v1", api_key=secret, max_retries=0)


def received(stack, path: str) -> dict:
    """The last body the upstream received on `path`."""
    return next(body for p, body in reversed(stack["fake"].received) if p == path)


def estimate_chat(messages) -> int:
    """The gateway's prompt count for an external pool (no tokenizer named: its documented estimate)."""
    return TokenCounter(None).count_chat(messages, 2048)


# --- n choices ------------------------------------------------------------------------------------------------


async def test_n_choices_pass_through_to_an_external_pool_and_reserve_n_times_max_tokens(stack):
    team, client = team_client(stack, TeamLimits(tpm=100_000))
    raw = await client.chat.completions.with_raw_response.create(model=EXTERNAL, messages=HELLO, n=3, max_tokens=5)
    resp = raw.parse()
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.message.content == "tok " * 5 for c in resp.choices)
    assert resp.usage.completion_tokens == 15  # OpenAI's usage sums the choices
    sent = received(stack, "/v1/chat/completions")
    assert (sent["n"], sent["max_tokens"]) == (3, 5), "the body keeps max_tokens per choice"
    # the reservation, as the tpm headers show it: the prompt once, 3 x 5 output tokens
    reserved = estimate_chat(HELLO) + 3 * 5
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) == 100_000 - reserved
    event = the_event(stack["events"], raw.headers["x-request-id"])
    assert (event["prompt_tokens"], event["completion_tokens"], event["max_tokens"]) == (6, 15, 15)
    assert event["team"] == team.id and event["status"] == "ok"


async def test_a_reservation_that_n_multiplies_past_the_tpm_limit_is_refused(stack):
    prompt = estimate_chat(HELLO)
    _, client = team_client(stack, TeamLimits(tpm=prompt + 40))
    with pytest.raises(openai.RateLimitError) as exc:
        await client.chat.completions.create(model=EXTERNAL, messages=HELLO, n=4, max_tokens=20)  # 80 output
    assert exc.value.code == "rate_limit_tokens" or "token" in exc.value.message
    resp = await client.chat.completions.create(model=EXTERNAL, messages=HELLO, n=2, max_tokens=20)  # 40: fits
    assert len(resp.choices) == 2


async def test_completions_n_and_best_of_reserve_the_larger(stack):
    _, client = team_client(stack, TeamLimits(tpm=100_000))
    raw = await client.completions.with_raw_response.create(
        model=EXTERNAL, prompt="one two three", n=2, best_of=3, max_tokens=4
    )
    assert len(raw.parse().choices) == 2
    reserved = TokenCounter(None).count_prompt("one two three") + 3 * 4
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) == 100_000 - reserved
    sent = received(stack, "/v1/completions")
    assert (sent["n"], sent["best_of"], sent["max_tokens"]) == (2, 3, 4)


@pytest.mark.parametrize("model", [EXTERNAL, ENGINE])
async def test_a_stream_of_n_choices_bills_every_choice(stack, model):
    _, client = team_client(stack)
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=HELLO, n=3, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in raw.parse()]
    by_choice: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            by_choice[c.index] = by_choice.get(c.index, "") + (c.delta.content or "")
    assert by_choice == {0: "tok " * 4, 1: "tok " * 4, 2: "tok " * 4}
    assert chunks[-1].usage.completion_tokens == 12
    event = the_event(stack["events"], raw.headers["x-request-id"])
    assert (event["completion_tokens"], event["max_tokens"]) == (12, 12)


async def test_a_stream_of_n_choices_without_usage_counts_every_choices_text(stack):
    """An external upstream that sends no usage: the gateway's estimate counts the deltas of all choices."""
    _, client = team_client(stack)
    raw = await client.chat.completions.with_raw_response.create(
        model=EXTERNAL, messages=HELLO, n=3, max_tokens=4, stream=True, extra_body={"fake": {"usage": False}}
    )
    chunks = [c async for c in raw.parse()]
    assert sum(len(c.choices) for c in chunks) == 12 and all(c.usage is None for c in chunks)
    event = the_event(stack["events"], raw.headers["x-request-id"])
    assert event["completion_tokens"] == TokenCounter(None).count_text("tok " * 12) == 12
    assert event["prompt_tokens"] == estimate_chat(HELLO)  # no usage: the prompt as counted at admission


async def test_n_choices_without_usage_bill_the_text_of_every_choice(stack):
    _, client = team_client(stack)
    raw = await client.chat.completions.with_raw_response.create(
        model=EXTERNAL, messages=HELLO, n=3, max_tokens=5, extra_body={"fake": {"usage": False}}
    )
    assert raw.parse().usage is None and len(raw.parse().choices) == 3
    event = the_event(stack["events"], raw.headers["x-request-id"])
    assert (event["prompt_tokens"], event["completion_tokens"]) == (estimate_chat(HELLO), 15)


def test_the_text_counted_without_usage_includes_tool_calls_of_every_choice():
    answer = {
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Sure."}},
            {
                "index": 1,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}],
                },
            },
        ]
    }
    assert stream_chunks.generated_text(answer) == 'Sure.f{"a":1}'
    assert stream_chunks.choice_text({"tool_calls": [{"index": 0, "function": {"arguments": '"x"'}}]}) == '"x"'
    assert stream_chunks.generated_text({"choices": [{"text": "a"}, {"text": "b"}]}) == "ab"


# --- fields passed through ------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    }
]
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        "strict": True,
    },
}


async def test_tools_response_format_and_sampling_fields_reach_the_upstream_untouched(stack):
    _, client = team_client(stack)
    fields = {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "response_format": RESPONSE_FORMAT,
        "logprobs": True,
        "top_logprobs": 5,
        "logit_bias": {"50256": -100, "13": 7},
        "seed": 42,
        "user": "alice@example.com",
        "temperature": 0.3,
    }
    await client.chat.completions.create(model=EXTERNAL, messages=HELLO, max_tokens=2, **fields)
    sent = received(stack, "/v1/chat/completions")
    for key, value in fields.items():
        assert sent[key] == value, key
    assert sent["model"] == UPSTREAM_MODEL and "priority" not in sent
    for fmt in ({"type": "text"}, {"type": "json_object"}):
        await client.chat.completions.create(model=EXTERNAL, messages=HELLO, max_tokens=1, response_format=fmt)
        assert received(stack, "/v1/chat/completions")["response_format"] == fmt


# --- /v1/embeddings -------------------------------------------------------------------------------------------


async def test_embeddings_are_counted_reserved_and_billed_from_the_upstreams_usage(stack):
    team, client = team_client(stack, TeamLimits(tpm=10_000))
    inputs = ["hello embedding world", "a b c d"]
    raw = await client.embeddings.with_raw_response.create(model=EXTERNAL, input=inputs)
    resp = raw.parse()
    assert [d.index for d in resp.data] == [0, 1]
    assert [d.embedding for d in resp.data] == [embedding_vector(x, 8) for x in inputs]  # base64 from the SDK
    assert received(stack, "/v1/embeddings")["encoding_format"] == "base64"
    assert resp.usage.prompt_tokens == 7  # the fake's rule: one token per word
    counted = TokenCounter(None).count_prompt(inputs)  # reserved: the input as the pool's counter sees it, no output
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) == 10_000 - counted
    event = the_event(stack["events"], raw.headers["x-request-id"])
    assert (event["prompt_tokens"], event["completion_tokens"], event["max_tokens"]) == (7, 0, 0)
    assert event["team"] == team.id and event["status"] == "ok" and event["stream"] is False
    assert event.get("kind", "embeddings") == "embeddings"


async def test_embeddings_of_token_ids_in_floats_with_dimensions(stack):
    _, client = team_client(stack)
    resp = await client.embeddings.create(
        model=EXTERNAL, input=[[1, 2, 3], [4, 5]], encoding_format="float", dimensions=4
    )
    assert [d.embedding for d in resp.data] == [embedding_vector([1, 2, 3], 4), embedding_vector([4, 5], 4)]
    assert resp.usage.prompt_tokens == 5
    sent = received(stack, "/v1/embeddings")
    assert (sent["input"], sent["dimensions"], sent["model"]) == ([[1, 2, 3], [4, 5]], 4, UPSTREAM_MODEL)


async def test_embeddings_base64_decodes_to_the_same_floats(stack):
    _, client = team_client(stack)
    raw = await client.embeddings.with_raw_response.create(model=EXTERNAL, input="one", encoding_format="base64")
    vector = raw.http_response.json()["data"][0]["embedding"]
    assert list(struct.unpack("<8f", base64.b64decode(vector))) == embedding_vector("one", 8)


@pytest.mark.parametrize("model", [ENGINE, NO_EMBEDDINGS])
async def test_a_pool_without_embeddings_answers_400_naming_the_model(stack, model):
    _, client = team_client(stack)
    seen = stack["fake"].requests_seen
    with pytest.raises(openai.BadRequestError) as exc:
        await client.embeddings.create(model=model, input="hello")
    assert (exc.value.code, exc.value.param) == ("model_not_supported", "model")
    assert f"'{model}'" in exc.value.message and "embeddings" in exc.value.message
    assert stack["fake"].requests_seen == seen
    event = the_event(stack["events"], exc.value.response.headers["x-request-id"])
    assert event["status"] == "rejected" and event["reason"] == "model_not_supported"


async def test_embeddings_for_an_unknown_or_forbidden_model(stack):
    _, client = team_client(stack, TeamLimits(allowed_models=(UNSIZED,)))
    with pytest.raises(openai.NotFoundError) as exc:
        await client.embeddings.create(model="no-such-model", input="hello")
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.PermissionDeniedError) as exc:
        await client.embeddings.create(model=EXTERNAL, input="hello")
    assert exc.value.code == "model_not_allowed"


@pytest.mark.parametrize(
    ("kwargs", "param", "code"),
    [
        ({"input": ""}, "input", "invalid_value"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": ["a", 1]}, "input.1", "invalid_type"),
        ({"input": [[1], [-2]]}, "input.1.0", "invalid_value"),
        ({"input": {"text": "a"}}, "input", "invalid_type"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", "invalid_value"),
        ({"input": "a", "dimensions": 0}, "dimensions", "invalid_value"),
    ],
    ids=["empty string", "empty list", "mixed list", "negative token id", "object", "encoding_format", "dimensions"],
)
async def test_bad_embedding_inputs_get_a_400_naming_the_field(stack, kwargs, param, code):
    _, client = team_client(stack)
    seen = stack["fake"].requests_seen
    with pytest.raises(openai.BadRequestError) as exc:
        await client.embeddings.create(model=EXTERNAL, **kwargs)
    assert (exc.value.code, exc.value.param) == (code, param)
    assert f"'{param}'" in exc.value.message
    assert stack["fake"].requests_seen == seen


# --- /v1/models -----------------------------------------------------------------------------------------------


async def test_models_list_and_retrieve_report_max_model_len(stack):
    _, client = team_client(stack)
    deadline = time.monotonic() + 5
    while True:  # the engine's length is learned from its /v1/models by the load poller
        cards = {m.id: m.model_dump() for m in (await client.models.list()).data}
        if cards[ENGINE]["max_model_len"] is not None or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert {name: card["max_model_len"] for name, card in cards.items()} == {
        EXTERNAL: 8192,  # the pool's max_context
        ENGINE: 2048,  # the engine's own
        NO_EMBEDDINGS: None,
        UNSIZED: None,
    }
    model = await client.models.retrieve(EXTERNAL)
    assert (model.id, model.object, model.owned_by) == (EXTERNAL, "model", "tokenweir")
    assert model.model_dump()["max_model_len"] == 8192


async def test_retrieving_an_unknown_or_forbidden_model_is_404(stack):
    _, client = team_client(stack, TeamLimits(allowed_models=(UNSIZED,)))
    assert (await client.models.retrieve(UNSIZED)).id == UNSIZED
    for name in ("no-such-model", EXTERNAL, "org/model-with-a-slash"):
        with pytest.raises(openai.NotFoundError) as exc:
            await client.models.retrieve(name)
        assert (exc.value.code, exc.value.param) == ("model_not_found", "model")
        assert f"'{name}'" in exc.value.message


# --- shapes -----------------------------------------------------------------------------------------------------

BAD_SHAPES = {
    "n of 129": ({"n": 129}, "n", "invalid_value"),
    "n of 0": ({"n": 0}, "n", "invalid_value"),
    "a tool without its function": (
        {"tools": [{"type": "function"}]}, "tools.0.function", "missing_required_parameter"
    ),
    "a function name with a space": (
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name",
        "invalid_value",
    ),
    "function parameters not an object schema": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools.0.function.parameters.type", "invalid_value",
    ),
    "function parameters as an array": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools.0.function.parameters", "invalid_type",
    ),
    "an unknown tool_choice": ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    "tool_choice without a function name": (
        {"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name",
        "missing_required_parameter",
    ),
    "an unknown response_format type": ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    "response_format without a type": ({"response_format": {}}, "response_format.type", "missing_required_parameter"),
    "json_schema without its schema object": (
        {"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing_required_parameter"
    ),
    "json_schema without a name": (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name",
        "missing_required_parameter",
    ),
    "a logit_bias key that is no token id": ({"logit_bias": {"hello": 5}}, "logit_bias.hello", "invalid_value"),
    "a logit_bias value past 100": ({"logit_bias": {"13": 101}}, "logit_bias.13", "invalid_value"),
    "a fractional logit_bias value": ({"logit_bias": {"13": 1.5}}, "logit_bias.13", "invalid_type"),
    "top_logprobs past 20": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    "seed as a string": ({"seed": "42"}, "seed", "invalid_type"),
    "user as a number": ({"user": 7}, "user", "invalid_type"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_SHAPES.values(), ids=BAD_SHAPES.keys())
async def test_bad_field_shapes_get_a_400_naming_the_field(stack, case):
    fields, param, code = case
    _, client = team_client(stack)
    seen = stack["fake"].requests_seen
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=EXTERNAL, messages=HELLO, max_tokens=2, **fields)
    error = exc.value.body
    assert (exc.value.code, exc.value.param, error["type"]) == (code, param, "invalid_request_error")
    assert f"'{param}'" in exc.value.message
    assert stack["fake"].requests_seen == seen, "a refused request reached the upstream"


async def test_best_of_below_n_is_refused(stack):
    _, client = team_client(stack)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model=EXTERNAL, prompt="x", n=3, best_of=2, max_tokens=1)
    assert (exc.value.code, exc.value.param) == ("invalid_value", "best_of")


async def test_embeddings_past_the_teams_prompt_cap_are_refused_naming_input(stack):
    _, client = team_client(stack, TeamLimits(max_prompt_tokens=3))
    with pytest.raises(openai.BadRequestError) as exc:
        await client.embeddings.create(model=EXTERNAL, input=["one two three four five six seven"])
    assert (exc.value.code, exc.value.param) == ("context_length_exceeded", "input")
    assert "input" in exc.value.message
    assert len((await client.embeddings.create(model=EXTERNAL, input="short")).data) == 1
