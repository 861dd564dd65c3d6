"""Speculative decoding behind the engine's HTTP API, on a tiny random Llama (prompt lookup proposes drafts from the
repeated prompt; this seed's model accepts a few and refuses most, so both paths run; acceptance on the real model is
tests/contract/engine/test_speculative.py's): the same tokens as without it, a stream carrying several tokens a step,
vLLM's spec_decode counters on /metrics, each request's drafts in its usage (OpenAI's accepted_prediction_tokens and
rejected_prediction_tokens), and a request's `"speculative": false` keeps it out."""

import pytest
from openai.types import CompletionUsage

from tests.app.engine.test_server import greedy_reference, make_engine, serve
from tests.support.tiny_llama import make_tiny_llama
from tokenweir.engine.config import SpeculativeConfig

PROMPT = [5, 17, 42, 5, 17, 42, 5, 17]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-spec")), seed=4, max_position_embeddings=512)


async def test_speculation_keeps_the_tokens_counts_its_drafts_and_can_be_refused_per_request(model_dir):
    expected = greedy_reference(model_dir, PROMPT, 48)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, cost_aware=False)
    async with serve(make_engine(model_dir, speculative=spec)) as served:
        body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        r = await served.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected and r.json()["usage"]["completion_tokens"] == 48
        metrics = await served.metrics()
        drafted = metrics["tokenweir:spec_decode_num_draft_tokens_total"]
        accepted = metrics["tokenweir:spec_decode_num_accepted_tokens_total"]
        assert metrics["tokenweir:spec_decode_num_drafts_total"] > 0 and 0 < accepted < drafted
        assert metrics["tokenweir:generation_tokens_total"] == 48
        # the request's own drafts, under OpenAI's names (its Predicted Outputs' usage), as the SDK reads them
        details = CompletionUsage.model_validate(r.json()["usage"]).completion_tokens_details
        assert details is not None
        assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (
            accepted,
            drafted - accepted,
        )
        r = await served.post("/v1/completions", {**body, "speculative": False})
        assert r.json()["choices"][0]["token_ids"] == expected
        assert "completion_tokens_details" not in r.json()["usage"]  # no drafts, no details
        after = await served.metrics()
        assert after["tokenweir:spec_decode_num_draft_tokens_total"] == drafted  # not one draft for it
        assert after["tokenweir:generation_tokens_total"] == 96
        r = await served.post("/v1/completions", {**body, "speculative": "sometimes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"


async def test_a_stream_with_speculation_carries_every_token_once(model_dir):
    from tests.app.engine.test_server import sse_events

    expected = greedy_reference(model_dir, PROMPT, 40)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2, cost_aware=False)
    async with serve(make_engine(model_dir, speculative=spec)) as served:
        body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
        body |= {"return_token_ids": True, "logprobs": 2, "stream_options": {"include_usage": True}}
        r = await served.post("/v1/completions", body)
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        tokens = [t for e in chunks for t in e["choices"][0].get("token_ids") or []]
        assert tokens == expected
        logprobs = [t for e in chunks if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]]
        assert len(logprobs) == 40
        assert any(len(e["choices"][0].get("token_ids") or []) > 1 for e in chunks), "a step with accepted drafts"
        usage = events[-2]["usage"]
        assert usage["completion_tokens"] == 40 and usage["completion_tokens_details"]["accepted_prediction_tokens"] > 0
