"""Speculative decoding on the real default model (prompt lookup, with the n-gram cache learned across requests, and
by a draft model: the default model drafting for itself), checked against the same engine without it: greedy tokens
identical on 56 prompts (chat, code, JSON, copy-heavy edits, stories), alone and batched with strangers, with chunked
prefill and prefix caching on, under preemption, with stop strings, max_tokens, n > 1, penalties, logprobs and
structured outputs (valid under their schema); sampling at temperature 1 not told apart by a chi-square test; every
KV block back in the pool (the draft model's too) after accepted, refused, aborted and preempted drafts; the drafts
really ran (acceptance counted in the metrics)."""

import json
from dataclasses import replace

import jsonschema
import pytest
import torch

from tokenweir.common.text.model_files import default_model_path
from tokenweir.engine.config import SpeculativeConfig
from tokenweir.engine.core.metrics import EngineMetrics
from tokenweir.engine.llm import LLM
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.spec.draft_model_proposer import DraftModelProposer

pytestmark = pytest.mark.slow
SPEC = SpeculativeConfig(
    num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=None, cost_aware=False
)
# batch_invariant: kernels whose rows do not move with the batch, else a verification row rounds unlike a decode row
# (on a GPU a bf16 GEMM picked by the batch's shape, on CPU bf16 prefill attention) and a near tie can go either way
ENGINE = {
    "max_num_batched_tokens": 64,
    "max_num_seqs": 16,
    "num_kv_blocks": 400,
    "enable_prefix_caching": True,
    "batch_invariant": True,
}


def build_prompts() -> list[str]:
    code = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    record = {"name": "Ada", "born": 1815, "field": "mathematics", "city": "London"}
    prompts = [
        f"{code}\nRename w to width and h to height in the code above:\n",
        f"{code}\nAdd type hints to the code above:\n",
        f"{json.dumps(record)}\nRepeat the JSON above with the city in upper case:\n",
        f"{json.dumps(record)}\nExtract the name and the city as JSON:\n",
        "Copy this sentence exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
        "List: red, green, blue, red, green, blue, red, green,",
        "Once upon a time",
        "The capital of France is",
        "Write a haiku about the sea.",
        "Quote the first line of this text and summarize it. Text: Rivers carry water from the hills to the sea.",
    ]
    for i in range(46):
        items = ", ".join(f"item{j * (i + 3) % 17}" for j in range(6 + i % 5))
        kind = i % 4
        if kind == 0:
            prompts.append(f"Repeat the list twice: {items}.")
        elif kind == 1:
            prompts.append(
                f"def f{i}(x):\n    return x + {i}\n\ndef g{i}(x):\n    return f{i}(x) * {i}\n\nTest f{i}:\n"
            )
        elif kind == 2:
            prompts.append(json.dumps({"id": i, "tags": items.split(", ")}) + "\nThe tags above, one per line:\n")
        else:
            prompts.append(f"Story {i}: a fox named {items.split(', ')[0]} walked into the forest and")
    return prompts


PROMPTS = build_prompts()


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(default_model_path(), **ENGINE)


def counted(speculative: SpeculativeConfig) -> LLM:
    """An engine speculating as configured, its steps counted in metrics of its own."""
    llm = LLM(default_model_path(), speculative=speculative, **ENGINE)
    llm.engine_metrics = EngineMetrics("spec")  # type: ignore[attr-defined]
    step = llm.engine.step

    def counted_step():
        outputs = step()
        llm.engine_metrics.observe_step(llm.engine.last_stats, 0.0)  # type: ignore[attr-defined]
        return outputs

    llm.engine.step = counted_step  # type: ignore[method-assign]
    return llm


@pytest.fixture(scope="module")
def spec() -> LLM:
    return counted(SPEC)


@pytest.fixture(scope="module")
def spec_cache() -> LLM:
    return counted(replace(SPEC, method="ngram_cache"))


@pytest.fixture(scope="module")
def spec_draft() -> LLM:
    """The default model drafting for itself: correctness, not speed."""
    return counted(replace(SPEC, method="draft_model", model=default_model_path()))


def greedy(max_tokens: int = 32, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **extra)


def metric(llm: LLM, name: str) -> float:
    value = llm.engine_metrics.registry.get_sample_value(f"tokenweir:{name}_total", {"model_name": "spec"})  # type: ignore[attr-defined]
    return value or 0.0


def all_blocks_free(llm: LLM) -> bool:
    """Every KV block back in the pool, the draft model's too."""
    pools = [llm.engine.block_manager]
    if isinstance(llm.engine.proposer, DraftModelProposer):
        llm.engine.proposer.release_finished()
        pools.append(llm.engine.proposer.block_manager)
    full = all(bm.num_free_blocks == bm.num_blocks for bm in pools)
    return full and not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def plain_greedy(plain) -> tuple[list[list[int]], list[list[int]]]:
    """Plain decoding's greedy tokens for PROMPTS, each prompt alone and all batched (computed once: both methods
    below compare against them)."""
    alone = [plain.generate([p], greedy())[0].new_token_ids for p in PROMPTS]
    return alone, [o.new_token_ids for o in plain.generate(PROMPTS, greedy())]


@pytest.mark.parametrize("method", ["spec", "spec_cache"])
def test_greedy_tokens_equal_plain_decoding_alone_and_batched_and_the_drafts_ran(plain_greedy, method, request):
    spec = request.getfixturevalue(method)
    assert len(PROMPTS) >= 50
    drafts_before = metric(spec, "spec_decode_num_draft_tokens")
    alone = [spec.generate([p], greedy())[0].new_token_ids for p in PROMPTS]
    assert alone == plain_greedy[0]
    batched = [o.new_token_ids for o in spec.generate(PROMPTS, greedy())]
    assert batched == plain_greedy[1]
    drafted = metric(spec, "spec_decode_num_draft_tokens") - drafts_before
    accepted = metric(spec, "spec_decode_num_accepted_tokens")
    assert drafted > 500 and 0.2 * drafted < accepted < drafted, (drafted, accepted)
    per_pos = [
        spec.engine_metrics.registry.get_sample_value(  # type: ignore[attr-defined]
            "tokenweir:spec_decode_num_accepted_tokens_per_pos_total", {"model_name": "spec", "position": str(i)}
        )
        for i in range(4)
    ]
    assert per_pos[0] >= per_pos[1] >= per_pos[2] >= per_pos[3] > 0 and sum(per_pos) == accepted
    assert all_blocks_free(spec)


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
