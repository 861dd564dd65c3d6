"""Tool calls the model chooses, with the real SmolLM2 tokenizer and the real grammar library: walks through the
hermes and llama3_json grammars end in calls that validate against their functions' schemas, text never holds a
call's opening, and the streamed deltas add up to the whole answer's content and calls."""

import json
import random

import jsonschema
import numpy as np
import pytest

from tokenweir.common.text.tokenizer import Tokenizer
from tokenweir.engine.api.chosen_calls import ChosenCalls
from tokenweir.engine.text.structured import StructuredOutputs
from tokenweir.engine.text.token_bitmask import unpack_masks
from tokenweir.engine.tool_parsers import TOOL_PARSERS, tool_parser

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "number"}, "note": {"type": "string", "maxLength": 8}},
    "required": ["a", "b"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: an empty object
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object", "properties": {}}}
# What the model writes before its calls in each format, forced by the walks below.
CALL_START = {"hermes": "Let me check.<tool_call>\n", "llama3_json": ""}


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def so(tok) -> StructuredOutputs:
    return StructuredOutputs(tok, tok.vocab_size, set(tok.stop_token_ids))


def walk(so: StructuredOutputs, tok: Tokenizer, matcher, forced: list[int], rng: random.Random) -> str:
    """Feed `forced`, then sample uniformly among allowed tokens for a while, then steer to the end (a stop token as
    soon as one is allowed, else closing quotes and brackets, else the shortest tokens). Stop tokens must be allowed
    exactly where the grammar accepts."""
    for t in forced:
        assert matcher.accept(t), f"the grammar refused {tok.decode(forced)!r}"
    ids = list(forced)
    for step in range(400):
        allowed = np.nonzero(unpack_masks(so.fill_masks([matcher]), tok.vocab_size)[0].numpy())[0]
        stop_ok = any(int(t) in so.stop_token_ids for t in allowed)
        assert stop_ok == matcher.is_accepting
        if step < 25:
            choice = int(rng.choice(allowed))
        elif stop_ok:
            choice = next(int(t) for t in allowed if int(t) in so.stop_token_ids)
        else:
            closing = [int(t) for t in allowed if set(tok.token_bytes(int(t))) <= set(b'"]}')]
            shortest = min(len(tok.token_bytes(int(t))) for t in allowed)
            choice = rng.choice(closing or [int(t) for t in allowed if len(tok.token_bytes(int(t))) == shortest])
        assert matcher.accept(choice)
        if choice in so.stop_token_ids:
            return tok.decode(ids)
        ids.append(choice)
    raise AssertionError(f"no stop after 400 steps: {tok.decode(ids)!r}")


@pytest.mark.slow  # ~15 s of mask walks: with the rest, not in the fast loop
@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("parallel", [True, False])
def test_every_call_a_walk_makes_validates_against_its_function(so, tok, name, parallel):
    parser = tool_parser(name)
    grammar = so.compile({"type": "grammar", "grammar": parser.grammar(TOOLS, parallel)})
    for seed in range(6):
        forced = tok.encode(CALL_START[name] + "{")  # a call begins; the walk writes the rest
        text = walk(so, tok, so.matcher(grammar), forced, random.Random(f"{name}{seed}"))
        parsed = parser.parse(text, final=True)
        assert parsed.calls and all(c.complete for c in parsed.calls), text
        assert parallel or len(parsed.calls) == 1, text
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert "<tool_call>" not in parsed.content


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_plain_text_is_an_answer_and_a_call_cannot_name_another_function(so, tok, name):
    parser = tool_parser(name)
    grammar = so.compile({"type": "grammar", "grammar": parser.grammar(TOOLS, True)})
    m = so.matcher(grammar)
    for t in tok.encode("It is sunny in Paris today."):
        assert m.accept(t)
    assert m.is_accepting and parser.parse("It is sunny in Paris today.", final=True).calls == []
    m = so.matcher(grammar)
    for t in tok.encode(CALL_START[name] + '{"name":"'):
        assert m.accept(t)
    assert not m.accept(tok.encode("delete")[0]), "only the offered functions may be called"
    assert not any(m.accept(s) for s in so.stop_token_ids), "no stop inside a call"


def test_hermes_text_cannot_hold_a_call_opening_and_content_keeps_its_text(so, tok):
    parser = tool_parser("hermes")
    m = so.matcher(so.compile({"type": "grammar", "grammar": parser.grammar(TOOLS, True)}))
    for t in tok.encode("Sure <tool_call>\n"):  # ".<" and " <" merge into one token: the lexer takes them
        assert m.accept(t)
    assert not m.accept(tok.encode("hello")[0]), "after an opening tag comes a call"
    text = 'Sure.<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>'
    parsed = parser.parse(text, final=True)
    assert parsed.content == "Sure." and [(c.name, c.arguments) for c in parsed.calls] == [("now", "{}")]


def test_llama3_text_may_not_start_a_call_it_cannot_finish(so, tok):
    parser = tool_parser("llama3_json")
    m = so.matcher(so.compile({"type": "grammar", "grammar": parser.grammar(TOOLS, False)}))
    for t in tok.encode('{"name":"add","parameters":{"a":1,"b":2}}'):
        assert m.accept(t)
    assert m.is_accepting and not m.accept(tok.encode(";")[0]), "one call when parallel_tool_calls is false"


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_streamed_deltas_add_up_to_the_whole_answer(tok, name):
    parser = tool_parser(name)
    if name == "hermes":
        text = (
            'Checking <tool_c nothing>. <tool_call>\n{"name":"get_weather","arguments":{"city":"Pa\\"ris}","unit":'
            '"celsius"}}\n</tool_call>\n<tool_call>\n{"name":"add","arguments":{"a":1,"b":[2]}}\n</tool_call>'
        )
    else:
        text = (
            '{"name":"get_weather","parameters":{"city":"Pa\\"ris}","unit":"celsius"}}; {"name":"add","parameters":{}}'
        )
    whole, called = ChosenCalls(parser).message(text)
    assert called and whole.tool_calls is not None
    for cut in ([1] * len(text), [t for t in map(len, (tok.decode([i]) for i in tok.encode(text)))]):
        stream, at, content, names, arguments, ids = ChosenCalls(parser), 0, "", {}, {}, {}
        for k, size in enumerate(cut):
            delta, _ = stream.delta(0, text[at : at + size], finished=k == len(cut) - 1)
            at += size
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in ids and d.function.name and d.type == "function"
                    ids[d.index], names[d.index] = d.id, d.function.name
                arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
        assert content == (whole.content or "")
        assert [names[i] for i in sorted(names)] == [c.function.name for c in whole.tool_calls]
        assert [arguments[i] for i in sorted(arguments)] == [c.function.arguments for c in whole.tool_calls]
        assert "<tool_c" not in content.replace("<tool_c nothing>", "")
