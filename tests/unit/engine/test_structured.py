"""Structured outputs with the real SmolLM2 tokenizer and the real grammar library: random walks through each
schema's masks must decode to JSON that validates; masks must agree with what the matcher accepts token by token."""

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch

from tokenweir.common.text.tokenizer import Tokenizer
from tokenweir.engine.text.structured import StructuredOutputs
from tokenweir.engine.text.token_bitmask import apply_token_bitmask, unpack_masks

VOCAB = 49152

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "active": {"type": "boolean"}},
        "required": ["name", "age", "active"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string", "maxLength": 10}},
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "status": {"type": "string", "enum": ["pending", "shipped", "delivered"]},
            "priority": {"type": "integer", "enum": [1, 2, 3]},
            "mixed": {"enum": ["a", 7, None, True]},
        },
        "required": ["status", "priority", "mixed"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                    "required": ["id", "tags"],
                },
            }
        },
        "required": ["items"],
    },
    "optional": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "year": {"type": "integer"},
            "rating": {"type": "number"},
            "notes": {"type": "string"},
        },
        "required": ["title"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 0, "maximum": 100},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "delta": {"type": "number"},
        },
        "required": ["count", "ratio", "delta"],
    },
    "booleans_null": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "nothing": {"type": "null"}, "maybe": {"type": ["boolean", "null"]}},
        "required": ["ok", "nothing", "maybe"],
    },
    "string_enum_array": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 4},
            "kind": {"const": "palette"},
        },
        "required": ["colors", "kind"],
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "integer"}]}},
        "required": ["value"],
    },
    "refs": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    },
}


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def so(tok) -> StructuredOutputs:
    return StructuredOutputs(tok, VOCAB, set(tok.stop_token_ids))


def spec(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


def allowed_ids(so: StructuredOutputs, matcher) -> np.ndarray:
    return np.nonzero(unpack_masks(so.fill_masks([matcher]), VOCAB)[0].numpy())[0]


def random_walk(so, tok, matcher, rng: random.Random, explore: int = 40, limit: int = 400) -> list[int]:
    """Sample uniformly among allowed tokens for `explore` steps, then steer to the end: a stop token as soon as one
    is allowed, else closing quotes/brackets, else the shortest allowed tokens. Checks at every step that stop tokens
    are allowed exactly where the text so far is a complete document."""
    stops = so.stop_token_ids
    closers = set(b'"]}')
    ids: list[int] = []
    for step in range(limit):
        allowed = allowed_ids(so, matcher)
        assert len(allowed) > 0, f"empty mask after {tok.decode(ids)!r}"
        stop_ok = any(int(t) in stops for t in allowed)
        assert stop_ok == matcher.is_accepting, f"stop allowed={stop_ok} vs accepting at {tok.decode(ids)!r}"
        if stop_ok:
            json.loads(tok.decode(ids))  # a stop token is only ever allowed after a complete document
        if step >= explore:
            if stop_ok:
                choice = next(int(t) for t in allowed if int(t) in stops)
            else:
                closing = [int(t) for t in allowed if set(tok.token_bytes(int(t))) <= closers]
                if closing:
                    choice = rng.choice(closing)
                else:
                    shortest = min(len(tok.token_bytes(int(t))) for t in allowed)
                    choice = rng.choice([int(t) for t in allowed if len(tok.token_bytes(int(t))) == shortest])
        else:
            choice = int(rng.choice(allowed))
        assert matcher.accept(choice), f"matcher refused token {choice} its mask allowed"
        if choice in stops:
            assert matcher.is_terminated
            return ids
        ids.append(choice)
    raise AssertionError(f"no stop token after {limit} steps: {tok.decode(ids)!r}")


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walk_yields_valid_json(so, tok, name):
    schema = SCHEMAS[name]
    grammar = so.compile(spec(schema))
    for seed in range(3):
        matcher = so.matcher(grammar)
        ids = random_walk(so, tok, matcher, random.Random(f"{name}-{seed}"))
        text = tok.decode(ids)
        doc = json.loads(text)
        jsonschema.validate(doc, schema)
        outside = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)  # compact: no whitespace outside strings
        assert not any(c.isspace() for c in outside), f"whitespace outside strings: {text!r}"


def test_json_object_is_any_compact_object(so, tok):
    grammar = so.compile({"type": "json_object"})
    for seed in range(4):
        ids = random_walk(so, tok, so.matcher(grammar), random.Random(seed), explore=30)
        assert isinstance(json.loads(tok.decode(ids)), dict)
    # a nested document written by hand goes through token by token
    m = so.matcher(grammar)
    for t in tok.encode('{"a":[1,2.5,{"b":null}],"c":{"d":"x y"},"e":true}'):
        assert m.accept(t)
    assert m.is_accepting


def test_objects_are_closed_unless_the_schema_opens_them(so, tok):
    closed = so.matcher(so.compile(spec(SCHEMAS["flat"])))
    for t in tok.encode('{"name":"a","age":1,"active":true'):
        assert closed.accept(t)
    assert not closed.accept(tok.encode(",")[0]), "undeclared keys must not be allowed"
    open_schema = {**SCHEMAS["flat"], "additionalProperties": {"type": "integer"}}
    opened = so.matcher(so.compile(spec(open_schema)))
    for t in tok.encode('{"name":"a","age":1,"active":true,"extra":5}'):
        assert opened.accept(t)
    assert opened.is_accepting


def test_disallowed_token_is_rejected_and_state_kept(so, tok):
    m = so.matcher(so.compile(spec(SCHEMAS["flat"])))
    for bad in ("x", " ", "\n", "[", "{}"):
        assert not m.accept(tok.encode(bad)[0]), bad
    assert not any(m.accept(s) for s in so.stop_token_ids), "no stop token before the document"
    assert not m.accept(tok.token_to_id("<|im_start|>")), "special tokens are never text"
    for t in tok.encode('{"name":"Al"'):
        assert m.accept(t)
    assert not m.accept(tok.encode(" ")[0]), "no whitespace between tokens"
    assert not m.accept(tok.encode("}")[0]), "required keys are missing"
    for t in tok.encode(',"age":30,"active":false}'):
        assert m.accept(t)
    assert m.is_accepting and m.is_complete and not m.is_terminated
    assert not m.accept(tok.encode(",")[0])
    assert m.accept(tok.eos_token_id) and m.is_terminated
    assert not m.accept(tok.eos_token_id), "nothing after the stop token"
    m.rollback(2)  # the stop token and "}"
    assert not m.is_terminated and not m.is_accepting
    assert m.accept(tok.encode("}")[0]) and m.accept(tok.eos_token_id)


def test_masks_match_accept_and_apply_sets_exactly_forbidden_to_inf(so, tok):
    grammar = so.compile(spec(SCHEMAS["enums"]))
    prefixes = ["", '{"status":"', '{"status":"shipped","priority":', '{"status":"pending","priority":2,"mixed":']
    matchers = []
    for prefix in prefixes:
        m = so.matcher(grammar)
        for t in tok.encode(prefix):
            assert m.accept(t)
        matchers.append(m)
    masks = so.fill_masks(matchers)
    allowed = unpack_masks(masks, VOCAB)
    rng = random.Random(0)
    for m, row in zip(matchers, allowed, strict=True):
        ids = sorted(set(np.nonzero(row.numpy())[0].tolist()) | set(rng.sample(range(VOCAB), 300)))
        for t in ids:  # the parser's verdict token by token, against the mask's bit
            ok = m.accept(t)
            if ok:
                m.rollback(1)
            assert ok == bool(row[t]), (t, tok.token_bytes(t))
    # apply: -inf exactly where forbidden, the rest untouched
    logits = torch.randn(len(matchers), VOCAB)
    before = logits.clone()
    apply_token_bitmask(logits, masks)
    assert torch.equal(torch.isneginf(logits), ~allowed)
    assert torch.equal(logits[allowed], before[allowed])
    # rows: masks constrain only the named logits rows; a padded model vocab is forbidden past the mask
    wide = torch.randn(6, VOCAB + 64)
    before = wide.clone()
    so.apply_masks(wide, [4, 1], matchers[:2], masks=None)
    for r in (0, 2, 3, 5):
        assert torch.equal(wide[r], before[r])
    for r, row in ((4, allowed[0]), (1, allowed[1])):
        assert torch.equal(torch.isneginf(wide[r, :VOCAB]), ~row)
        assert torch.isneginf(wide[r, VOCAB:]).all()


def test_device_unpack_matches_numpy_unpack():
    """The torch path (used for CUDA logits) and the numpy path (CPU) agree bit for bit, padding included."""
    from tokenweir.engine.text.token_bitmask import _forbidden_bits, _forbidden_on_device

    masks = torch.randint(-(2**31), 2**31 - 1, (3, 1536), dtype=torch.int32)
    for vocab in (VOCAB, VOCAB - 5, VOCAB + 70):
        expected = torch.from_numpy(_forbidden_bits(masks, vocab))
        assert torch.equal(_forbidden_on_device(masks, vocab, torch.device("cpu")), expected)
    # bit j of word w is token 32 * w + j
    one = torch.zeros(1, 1536, dtype=torch.int32)
    one[0, 2] = 1 << 5
    assert unpack_masks(one, VOCAB)[0].nonzero().flatten().tolist() == [69]
    bf = torch.zeros(2, VOCAB, dtype=torch.bfloat16)  # not numpy-able: the torch fallback
    apply_token_bitmask(bf, torch.cat([one, one]))
    assert torch.isfinite(bf).sum().item() == 2 and bf[:, 69].eq(0).all()


def test_padded_model_vocab_never_allows_the_padding(tok):
    so = StructuredOutputs(tok, VOCAB + 40, set(tok.stop_token_ids))
    m = so.matcher(so.compile({"type": "json_object"}))
    masks = so.fill_masks([m])
    assert masks.shape == (1, (VOCAB + 40 + 31) // 32)
    allowed = unpack_masks(masks, VOCAB + 40)[0]
    assert allowed[tok.encode("{")[0]] and not allowed[VOCAB:].any()


def test_parallel_and_async_fill_match_sequential(tok, so):
    par = StructuredOutputs(tok, VOCAB, set(tok.stop_token_ids), num_threads=2)
    grammar_seq = so.compile(spec(SCHEMAS["nested"]))
    grammar_par = par.compile(spec(SCHEMAS["nested"]))
    text = '{"user":{"name":"Bo","address":{"city":"X","zip":"1"}}}'
    ids = tok.encode(text)
    seq = [so.matcher(grammar_seq) for _ in ids]
    pm = [par.matcher(grammar_par) for _ in ids]
    for k, _ in enumerate(ids):  # matcher k has taken the first k tokens
        for t in ids[:k]:
            assert seq[k].accept(t) and pm[k].accept(t)
    expected = so.fill_masks(seq)
    assert torch.equal(par.fill_masks(pm), expected)
    assert torch.equal(so.fill_masks_async(seq).result(), expected)
    par.close()


def test_compile_cache_is_bounded_lru(tok):
    so = StructuredOutputs(tok, VOCAB, set(tok.stop_token_ids), cache_size=2)
    a = so.compile(spec(SCHEMAS["flat"]))
    # the name and strict flag do not change the grammar; key order does not either
    same = {"type": "json_schema", "json_schema": {"schema": dict(reversed(list(SCHEMAS["flat"].items())))}}
    assert so.compile(same) is a
    enums = so.compile(spec(SCHEMAS["enums"]))
    so.compile(spec(SCHEMAS["flat"]))  # refresh: enums is now the oldest
    so.compile(spec(SCHEMAS["numbers"]))
    assert so.compile(spec(SCHEMAS["flat"])) is a
    assert so.compile(spec(SCHEMAS["enums"])) is not enums, "the oldest entry was evicted"
    assert so.compile({"type": "text"}) is None and so.matcher(None) is None


@pytest.mark.parametrize(
    ("response_format", "words"),
    [
        ("json", ["response_format", "object"]),
        ({"type": "xml"}, ["response_format.type", "'xml'"]),
        ({"type": "json_schema"}, ["response_format.json_schema"]),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, ["schema", "required"]),
        ({"type": "json_schema", "json_schema": {"schema": "string"}}, ["schema", "object"]),
        (spec({"type": "strin"}), ["JSON schema", "strin"]),
        (spec({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), ["not"]),
        (spec({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}), ["nope"]),
        (spec({"type": "integer", "minimum": 5, "maximum": 2}), ["minimum"]),
        (spec({"type": "string", "pattern": "(?<=a)b"}), ["look"]),
    ],
)
def test_invalid_specs_raise_helpful_value_errors(so, response_format, words):
    for _ in range(2):  # the second time from the cache, same message
        with pytest.raises(ValueError) as info:
            so.compile(response_format)
        msg = str(info.value)
        assert all(w.lower() in msg.lower() for w in words), msg
        assert len(msg) <= 400


@pytest.mark.slow
def test_smollm2_greedy_under_mask_writes_valid_json(tok, smollm2_float32_engine):
    """The real model, greedy, its logits masked each step by a loop of our own (no sampler): valid JSON, and the
    mask mattered (at some step the model's own argmax was a token the grammar forbids)."""
    from tokenweir.engine.model.attention import AttentionMetadata

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population_millions": {"type": "number"},
            "is_capital": {"type": "boolean"},
        },
        "required": ["city", "population_millions", "is_capital"],
    }
    model = smollm2_float32_engine.model  # float32, dense weights; this loop keeps its own KV pool
    so = StructuredOutputs(tok, model.config.vocab_size, set(tok.stop_token_ids))
    matcher = so.matcher(so.compile(spec(schema)))
    prompt = tok.encode_chat([{"role": "user", "content": "Describe Paris as JSON."}])
    kv = model.scratch_kv(len(prompt) + 64, 16)
    ids, out, overridden = list(prompt), [], 0
    start = 0
    with torch.inference_mode():  # the sampler's mode: the model's logits are inference tensors
        for _ in range(60):
            meta = AttentionMetadata.one_prefill(start, len(ids), len(kv[0][0]))
            logits = model.forward(
                torch.tensor(ids[start:]), meta.slot_mapping, kv, meta, torch.tensor([len(ids) - start - 1])
            )
            free = int(logits[0].argmax())
            so.apply_masks(logits, [0], [matcher])
            token = int(logits[0].argmax())
            overridden += token != free
            assert matcher.accept(token)
            if matcher.is_terminated:
                break
            start = len(ids)
            ids.append(token)
            out.append(token)
    text = tok.decode(out)
    assert matcher.is_terminated, f"no stop token: {text!r}"
    jsonschema.validate(json.loads(text), schema)
    assert overridden > 0, f"the mask never changed the model's choice: {text!r}"
