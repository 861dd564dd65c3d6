"""The OpenAI surface teams use, through `tokenweir serve` (gateway + bundled engine on SmolLM2) with the `openai`
SDK: n choices, logprobs, structured outputs and tool calls, streamed and not.

References nobody here wrote: `jsonschema` validates every structured output against the schema sent, and the
logprobs are checked against a direct log_softmax of the same model's logits (computed here, in process, with the
engine's own forward in float32, the mode the served engine runs in for this test)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch
import torch.nn.functional as F

from loadtests.fake_upstream import free_port
from tests.support.serve_process import serve_process

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
EXACT = ["--dtype", "float32", "--quantization", "none"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-surface")
    config = tmp / "tokenweir.yaml"
    config.write_text(json.dumps({"engine": {"extra_args": EXACT}}))  # JSON is YAML
    args = ["--config", str(config), "--port", str(free_port()), "--engine-port", str(free_port())]
    args += ["--store", f"sqlite:///{tmp / 'tw.db'}"]
    with serve_process(args, {"TOKENWEIR_EVENTS__PATH": str(tmp / "events.jsonl")}, timeout_s=240) as proc:
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key=proc.demo_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def engine(smollm2_float32_engine):
    """The same model in this process (float32, dense weights, as served here), for reference logits."""
    return smollm2_float32_engine


ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]


def test_n_choices(served):
    one = served.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=0)
    three = served.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in three.choices)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens

    sampled = served.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=1, n=3, seed=11)
    assert len({c.message.content for c in sampled.choices}) == 3

    stream = served.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=10,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == {0: one.choices[0].message.content, 1: one.choices[0].message.content}
    assert set(finish) == {0, 1} and usage.completion_tokens == 2 * one.usage.completion_tokens


def test_top_logprobs_match_the_models_own_distribution(served, engine):
    from tokenweir.engine.model.attention import AttentionMetadata

    chat = served.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    by_bytes = {engine.tokenizer.token_bytes(i): i for i in range(engine.tokenizer.vocab_size)}
    output = [by_bytes[bytes(e.bytes)] for e in entries]
    assert "".join(e.token for e in entries) == chat.choices[0].message.content
    prompt = engine.tokenizer.encode_chat(ASK)
    tokens = prompt + output
    with torch.inference_mode():
        kv = engine.model.scratch_kv(len(tokens), 16)
        meta = AttentionMetadata.one_prefill(0, len(tokens), len(kv[0][0]))
        logits = engine.model.forward(torch.tensor(tokens), meta.slot_mapping, kv, meta, torch.arange(len(tokens)))
        reference = F.log_softmax(logits.float(), dim=-1)
    for i, entry in enumerate(entries):
        row = reference[len(prompt) - 1 + i]
        assert len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        values, ids = row.topk(5)
        assert [by_bytes[bytes(t.bytes)] for t in entry.top_logprobs] == ids.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=2e-3)

    echo = served.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith("The sky is") and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == echo.choices[0].text and len(lp.tokens) == len(lp.text_offset)


# Bounded strings and numbers: the grammar guarantees valid JSON, not that a 135M model stops writing digits.
STRING = {"type": "string", "maxLength": 24}
COUNT = {"type": "integer", "minimum": 0, "maximum": 999}
SCHEMAS = [
    {"type": "object", "properties": {"name": STRING, "age": COUNT}, "required": ["name", "age"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "integer", "minimum": -10, "maximum": 10}},
        "required": ["ok"],
    },
    {"type": "object", "properties": {"tags": {"type": "array", "items": STRING, "maxItems": 3}}, "required": ["tags"]},
    {
        "type": "object",
        "properties": {"city": {"type": "object", "properties": {"name": STRING}, "required": ["name"]}},
        "required": ["city"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "object", "properties": {"id": COUNT}, "required": ["id"]},
            }
        },
        "required": ["items"],
    },
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "reason": STRING}, "required": ["answer"]},
    {"type": "object", "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["level"]},
    {
        "type": "object",
        "properties": {"first": STRING, "last": STRING, "email": STRING},
        "required": ["first", "last"],
    },
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
]
PROMPTS = [
    "Describe a person called Ann who is 31.",
    "Pick a colour.",
    "Is water wet? Give a score.",
    "Tag this post about cooking pasta.",
    "Where is the Eiffel tower?",
    "List two order ids.",
    "Should I take an umbrella today?",
    "Rate your mood from 1 to 5.",
    "Make up a contact card for Bob Stone.",
    "Choose some letters.",
]


def test_json_schema_outputs_validate(served):
    def ask(case: tuple[int, int]) -> tuple[dict, str, str]:
        schema, prompt = SCHEMAS[case[0]], PROMPTS[case[1]]
        chat = served.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
            max_tokens=160,
            temperature=0.7,
            seed=case[1],
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        )
        return schema, chat.choices[0].message.content, chat.choices[0].finish_reason

    # Every schema twice, batched 16 at a time: under the prompt written for it and under the next schema's prompt
    # (the model wants to write something else, the grammar must hold it). More prompts per schema only resample.
    cases = [(s, p) for s in range(len(SCHEMAS)) for p in (s, (s + 1) % len(PROMPTS))]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, cases))
    for schema, text, finish in results:
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)

    stream = served.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
        max_tokens=160,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}},
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[0])

    with pytest.raises(openai.BadRequestError) as bad:
        served.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
        )
    assert bad.value.body["param"] == "response_format" and "not" in bad.value.body["message"]


WEATHER = {
    "type": "object",
    "properties": {"city": STRING, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": STRING}, "required": ["zone"]},
        },
    },
]
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


def test_tool_calls_follow_their_schemas(served):
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = served.chat.completions.create(
        model=MODEL, messages=WEATHER_ASK, max_tokens=60, temperature=0, tools=TOOLS, tool_choice=named
    )
    message = chat.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    required = served.chat.completions.create(
        model=MODEL, messages=WEATHER_ASK, max_tokens=120, temperature=0, tools=TOOLS, tool_choice="required"
    )
    assert required.choices[0].finish_reason == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in required.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    stream = served.chat.completions.create(
        model=MODEL, messages=WEATHER_ASK, max_tokens=60, temperature=0, tools=TOOLS, tool_choice=named, stream=True
    )
    deltas = [c.choices[0].delta.tool_calls[0] for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments for d in deltas) == call_arguments(chat)


def test_an_agent_loop_on_calls_the_model_chooses(served, smollm2_tokenizer):
    """tool_choice left out ("auto"): the engine shows the tools in the hermes format and keeps any call the model
    starts to a valid one. SmolLM2-135M seldom starts one unprompted, so the client nudges it with OpenAI's own
    logit_bias toward the "<" that opens a call; what follows the opening is the model's and the grammar's.
    (Sampled runs, 50 a setting: loadtests/tool_agent.py; the grammar under random tokens: test_tool_parsers.py.)"""
    nudge = {str(smollm2_tokenizer.encode("<")[0]): 8}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    ask = dict(model=MODEL, tools=TOOLS, max_tokens=60, temperature=0, logit_bias=nudge, parallel_tool_calls=False)
    first = served.chat.completions.create(messages=WEATHER_ASK, **ask)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    stream = served.chat.completions.create(messages=WEATHER_ASK, stream=True, **ask)
    chunks = [c.choices[0] for c in stream if c.choices]
    deltas = [d for c in chunks for d in c.delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == call.function.name and {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].finish_reason == "tool_calls"

    # the result goes back as a tool turn; the model answers it, or calls again (validly)
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}
    turn = [*WEATHER_ASK, choice.message.model_dump(exclude_none=True), result]
    second = served.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=24, temperature=0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10, "the call and its result are in the prompt"
    for again in second.choices[0].message.tool_calls or []:
        jsonschema.validate(json.loads(again.function.arguments), schemas[again.function.name])


def call_arguments(chat) -> str:
    return chat.choices[0].message.tool_calls[0].function.arguments
