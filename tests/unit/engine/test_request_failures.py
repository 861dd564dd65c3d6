"""A request's failure stays that request's: a response_format whose grammar hits the parser's limits part-way, or an
error in one request's output handling, ends that request with a clear error while the requests batched with it
finish, the KV blocks all come back, and the engine keeps serving. Real SmolLM2, real llguidance."""

from __future__ import annotations

import pytest

from tokenweir.engine.core.errors import RequestError, RequestFailed
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.engine.core.output import RequestOutput
from tokenweir.engine.core.output_processor import TextState
from tokenweir.engine.sched.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

# String patterns that nest bounded repetitions: llguidance builds their lexer lazily and gives up ("too many
# expressions constructed") a few tokens in, after which its mask allows only a stop token it then refuses.
POISON_SCHEMAS = {
    "alternation": {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^(((ab|cd){1,40}){1,40}){1,40}$"}},
        "required": ["s"],
    },
    "classes": {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^((([a-f]|[0-9]){1,40}){1,40}){1,40}$"}},
        "required": ["s"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "pattern": "^(((x|[0-9]){1,40}){1,40}){1,40}$"}},
                    "required": ["code"],
                },
            }
        },
        "required": ["items"],
    },
}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "poison", "schema": schema}}


@pytest.fixture(scope="module")
def engine(smollm2_float32_engine) -> LLMEngine:
    # The session's engine (float32, dense weights): a request's failure is the scheduler's and the grammar's
    # business, whatever the weights' format.
    return smollm2_float32_engine


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, RequestOutput]:
    """Add every request (checked at the edge, as the server does), step to the end; each request's last output."""
    for rid, (prompt, params) in requests.items():
        tokens = engine.tokenizer.encode(prompt)
        engine.validate(tokens, params)
        engine.add_request(rid, tokens, params)
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    return last


def plain() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("name", sorted(POISON_SCHEMAS))
def test_a_grammar_past_the_parsers_limits_fails_its_request_and_the_batch_goes_on(engine, name):
    spec = response_format(POISON_SCHEMAS[name])
    requests = {"plain": ("The capital of France is", plain())}
    for seed in range(8):  # sampled, so several walks through the pattern: the lexer gives up within a few
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=64, structured=spec)
        requests[f"poison-{seed}"] = ("Write a JSON object.", params)
    outs = run(engine, requests)

    assert outs["plain"].finished and outs["plain"].finish_reason == "length" and outs["plain"].error is None
    assert outs["plain"].num_output_tokens == 24
    failed = [outs[rid] for rid in requests if rid.startswith("poison") and outs[rid].error is not None]
    assert failed, "no request hit the grammar's limit"
    for out in failed:
        assert out.finished and out.finish_reason == "error"
        assert isinstance(out.error, RequestError) and out.error.code == "invalid_response_format"
        assert out.error.param == "response_format" and "could not be followed" in str(out.error)
    assert not engine.output_processor.requests
    stats = engine.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # what is cached stays evictable
    # The same response_format is now refused at the edge: a 400 before a stream's first byte, not a failure later.
    with pytest.raises(RequestError, match="could not be followed"):
        engine.validate([1, 2, 3], SamplingParams(structured=spec))
    again = run(engine, {"after": ("The capital of France is", plain())})
    assert again["after"].finish_reason == "length" and again["after"].num_output_tokens == 24


def test_an_error_in_one_requests_output_ends_that_request_only(engine, monkeypatch):
    real_add = TextState.add
    broken: set[int] = set()

    def add(self: TextState, token_id: int):  # one request's detokenizing fails (a bug for one input)
        if id(self) in broken:
            raise UnicodeError("injected detokenizer fault")
        return real_add(self, token_id)

    monkeypatch.setattr(TextState, "add", add)
    for rid, (prompt, params) in {"good": ("Hello", plain()), "bad": ("Hi there", plain())}.items():
        tokens = engine.tokenizer.encode(prompt)
        engine.validate(tokens, params)
        engine.add_request(rid, tokens, params)
    broken.add(id(engine.output_processor.requests["bad"].texts[0]))
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    assert last["good"].finish_reason == "length" and last["good"].num_output_tokens == 24
    assert last["bad"].finish_reason == "error" and isinstance(last["bad"].error, RequestFailed)
    assert "injected detokenizer fault" in str(last["bad"].error)
    assert last["bad"].num_output_tokens == 1  # the token it made before failing is counted
    assert not engine.output_processor.requests
