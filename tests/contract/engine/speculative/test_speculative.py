"""Speculative decoding on the real default model (prompt lookup, with the n-gram cache learned across requests, and
by a draft model: the default model drafting for itself), checked against the same engine without it: greedy tokens
identical with stop strings, max_tokens, n > 1, penalties, logprobs and structured outputs (valid under their schema),
under preemption; sampling at temperature 1 not told apart by a chi-square test; every KV block back in the pool (the
draft model's too) after accepted, refused, aborted and preempted drafts; the drafts really ran (acceptance counted in
the metrics). The 56 prompts alone and batched: test_greedy_prompt_lookup.py and
test_greedy_ngram_cache.py (files of their own, so that the suite's workers run them side by side)."""

import json
from dataclasses import replace

import jsonschema
import pytest
import torch

from tests.support.speculative import ENGINE, PROMPTS, SPEC, all_blocks_free, greedy, metric
from tokenweir.common.text.model_files import default_model_path
from tokenweir.engine.config import SpeculativeConfig
from tokenweir.engine.llm import LLM
from tokenweir.engine.sched.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def test_a_draft_model_gives_plain_decodings_tokens_and_drafting_for_itself_is_almost_always_right(plain, spec_draft):
    prompts = PROMPTS[::3]
    drafted_before = metric(spec_draft, "spec_decode_num_draft_tokens")
    accepted_before = metric(spec_draft, "spec_decode_num_accepted_tokens")
    alone = [spec_draft.generate([p], greedy())[0].new_token_ids for p in prompts]
    assert alone == [plain.generate([p], greedy())[0].new_token_ids for p in prompts]
    batched = [o.new_token_ids for o in spec_draft.generate(prompts, greedy())]
    assert batched == [o.new_token_ids for o in plain.generate(prompts, greedy())]
    drafted = metric(spec_draft, "spec_decode_num_draft_tokens") - drafted_before
    accepted = metric(spec_draft, "spec_decode_num_accepted_tokens") - accepted_before
    # a draft is refused only where two ways of computing the same logits disagree on a near tie
    assert drafted > 300 and accepted >= 0.9 * drafted, (drafted, accepted)
    assert all_blocks_free(spec_draft)
    with pytest.raises(ValueError, match='"draft_model" takes the draft model'):
        SpeculativeConfig.from_json('{"method": "draft_model"}')
    assert SpeculativeConfig.from_json('{"model": "/m.gguf"}').method == "draft_model"  # as vLLM infers it


def test_stop_strings_max_tokens_n_penalties_and_logprobs_match_plain_decoding(plain, spec):
    cases = [
        greedy(40, stop=["height"]),
        greedy(40, stop=["\n\n"], include_stop_str_in_output=True),
        greedy(7),
        greedy(24, n=3),
        greedy(24, frequency_penalty=0.8, presence_penalty=0.5),
        greedy(24, logprobs=3),
        greedy(24, stop_token_ids=[28]),
    ]
    prompts = PROMPTS[:4]
    for params in cases:
        want = plain.generate(prompts, params)
        got = spec.generate(prompts, params)
        for w, g in zip(want, got, strict=True):
            assert g.new_token_ids == w.new_token_ids and g.new_text == w.new_text, params
            assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)
            if params.n == 1:  # with n > 1 the count is the request's so far, when choice 0 ended
                assert g.num_output_tokens == w.num_output_tokens == len(w.new_token_ids)
            if params.logprobs is not None:
                assert len(g.logprobs) == len(w.logprobs) == len(w.new_token_ids)
                for a, b in zip(g.logprobs, w.logprobs, strict=True):
                    assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 2e-3
                    assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert all_blocks_free(spec)


def test_structured_outputs_speculate_and_give_plain_decodings_tokens_valid_under_the_schema(plain, spec):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "born": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "born", "city"],
    }
    formats = [{"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}, {"type": "json_object"}]
    records = [
        {"name": n, "born": 1800 + 7 * i, "city": c}
        for i, (n, c) in enumerate(zip(["Ada", "Alan", "Grace"], ["London", "Wilmslow", "Arlington"], strict=True))
    ]
    # compact JSON in the prompt, as the grammar writes it, so the copy is there to be found
    prompts = [f"{json.dumps(r, separators=(',', ':'))}\nRepeat the JSON above exactly:\n" for r in records]
    prompts += PROMPTS[2:4]
    drafted_before = metric(spec, "spec_decode_num_draft_tokens")
    accepted_before = metric(spec, "spec_decode_num_accepted_tokens")
    for response_format in formats:
        for params in (greedy(48, structured=response_format), greedy(48, structured=response_format, logprobs=2)):
            want = plain.generate(prompts, params)
            got = spec.generate(prompts, params)
            for w, g in zip(want, got, strict=True):
                assert g.new_token_ids == w.new_token_ids and g.finish_reason == w.finish_reason, response_format
                if g.finish_reason == "stop":
                    document = json.loads(g.new_text)
                    if response_format["type"] == "json_schema":
                        jsonschema.validate(document, schema)
                if params.logprobs is not None:
                    assert [lp.token_id for lp in g.logprobs] == w.new_token_ids
    assert sum(o.finish_reason == "stop" for o in got) >= 3
    drafted = metric(spec, "spec_decode_num_draft_tokens") - drafted_before
    accepted = metric(spec, "spec_decode_num_accepted_tokens") - accepted_before
    assert drafted > 50 and accepted > 0.3 * drafted, (drafted, accepted)  # copying JSON: most drafts hold
    assert all_blocks_free(spec)


def test_a_grammar_that_refuses_a_draft_cuts_it_and_the_matcher_stands_where_it_was(plain):
    structured = plain.engine.structured
    grammar = structured.compile(
        {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
        }
    )
    tokenizer = plain.engine.tokenizer
    good = tokenizer.encode('{"a":12')
    bad = tokenizer.encode('"x"')
    matcher = structured.matcher(grammar)
    masks = structured.fill_draft_masks(matcher, good + bad)
    assert masks.shape[0] == len(good) + len(bad) + 1
    walker = structured.matcher(grammar)
    for j, token_id in enumerate(good):  # row j is the mask after the drafts before it
        assert torch.equal(masks[j], structured.fill_masks([walker])[0])
        assert walker.accept(token_id)
    after_good = structured.fill_masks([walker])[0]
    assert torch.equal(masks[len(good)], after_good)
    assert all(torch.equal(row, after_good) for row in masks[len(good) :])  # the refused draft ends the walk
    assert torch.equal(structured.fill_masks([matcher])[0], masks[0])  # rolled back to the start
    assert matcher.accept(good[0])


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_under_preemption_and_aborts_the_tokens_hold_and_every_block_returns(method):
    small = {**ENGINE, "num_kv_blocks": 16, "max_num_seqs": 8}  # tight: speculating sequences still preempt
    plain = LLM(default_model_path(), **small)
    draft = {"model": default_model_path()} if method == "draft_model" else {}
    spec = LLM(default_model_path(), speculative=replace(SPEC, method=method, **draft), **small)
    prompts = PROMPTS[:8]
    params = greedy(48, ignore_eos=True)
    expected = [o.new_token_ids for o in plain.generate(prompts, params)]
    assert [o.new_token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.engine.scheduler.num_preemptions > 0
    assert all_blocks_free(spec)
    engine = spec.engine
    for i, p in enumerate(prompts):
        tokens = engine.tokenizer.encode(p)
        request = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        engine.validate(tokens, request)
        engine.add_request(f"abort-{i}", tokens, request)
    for _ in range(12):
        engine.step()
    for i in range(len(prompts)):
        engine.abort_request(f"abort-{i}")
    assert all_blocks_free(spec)


def chi_square_p(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of homogeneity on counts per category (categories with 5+ expected)."""
    counts = torch.tensor([a, b], dtype=torch.float64)
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    df = counts.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(statistic / 2)))


def test_sampling_at_temperature_one_keeps_the_models_distribution(plain, spec):
    # the verification is the proposers' common path: any deterministic drafts are accepted with p(draft) and
    # refused into p without them, so one proposer's drafts stand for all (a draft model's are greedy, deterministic)
    prompt = "List: red, green, blue, red, green, blue, red, green, blue, red,"
    samples = 600

    def continuations(llm: LLM) -> dict[tuple[int, ...], int]:
        params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True) for s in range(samples)]
        counts: dict[tuple[int, ...], int] = {}
        for out in llm.generate([prompt] * samples, params):
            key = tuple(out.new_token_ids)
            counts[key] = counts.get(key, 0) + 1
        return counts

    drafted_before = metric(spec, "spec_decode_num_draft_tokens")
    accepted_before = metric(spec, "spec_decode_num_accepted_tokens")
    want, got = continuations(plain), continuations(spec)
    drafted = metric(spec, "spec_decode_num_draft_tokens") - drafted_before
    accepted = metric(spec, "spec_decode_num_accepted_tokens") - accepted_before
    assert drafted > samples // 2 and 0 < accepted < 0.95 * drafted, (drafted, accepted)  # both outcomes ran
    common = sorted(k for k in set(want) | set(got) if want.get(k, 0) + got.get(k, 0) >= 20)
    assert len(common) >= 2, (want, got)
    rest_want = samples - sum(want.get(k, 0) for k in common)
    rest_got = samples - sum(got.get(k, 0) for k in common)
    p = chi_square_p([want.get(k, 0) for k in common] + [rest_want], [got.get(k, 0) for k in common] + [rest_got])
    assert p > 0.001, (p, want, got)
    assert all_blocks_free(spec)
