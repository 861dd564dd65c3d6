"""n parallel choices, logprobs (sampled, top-k, prompt) and logit_bias on the real SmolLM2 model, in process.

References: the model's own logits from one direct forward over the whole sequence (no paged cache sharing, no
sampler), and the engine's n = 1 output for n > 1."""

import pytest
import torch
import torch.nn.functional as F

from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.engine.core.output import RequestOutput
from tokenweir.engine.model.attention import AttentionMetadata
from tokenweir.engine.sched.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2_float32_engine) -> LLMEngine:
    return smollm2_float32_engine  # the session's: float32, dense weights, 64 MiB of KV, a 1024-token context


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": "Name three colours of the rainbow."}])


def run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> dict[int, RequestOutput]:
    engine.validate(prompt, params)
    engine.add_request(rid, prompt, params)
    choices: dict[int, RequestOutput] = {}
    finished = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            choices.setdefault(out.index, RequestOutput.empty(rid, out.index)).add(out)
            finished += out.finished
    assert finished == 1, "exactly one output ends the request"
    assert not engine.output_processor.requests
    return choices


@torch.inference_mode()
def direct_logprobs(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position, from one prefill in a KV pool of its own."""
    model = engine.model
    kv = model.scratch_kv(len(token_ids), 16)
    meta = AttentionMetadata.one_prefill(0, len(token_ids), len(kv[0][0]))
    logits = model.forward(torch.tensor(token_ids), meta.slot_mapping, kv, meta, torch.arange(len(token_ids)))
    return F.log_softmax(logits.float(), dim=-1)


def test_n_greedy_choices_equal_the_single_answer_and_share_one_prefill(engine, prompt):
    one = run(engine, "one", prompt, SamplingParams(temperature=0, max_tokens=12))
    bm = engine.block_manager
    queries, hits = bm.prefix_cache_queries, bm.prefix_cache_hits
    three = run(engine, "three", prompt, SamplingParams(temperature=0, max_tokens=12, n=3))
    assert sorted(three) == [0, 1, 2]
    for choice in three.values():
        assert choice.new_token_ids == one[0].new_token_ids and choice.new_text == one[0].new_text
        assert choice.finish_reason == one[0].finish_reason
    assert three[2].num_output_tokens == 3 * one[0].num_output_tokens and three[2].num_prompt_tokens == len(prompt)
    # Choices 1 and 2 took every full block of the prompt from choice 0's prefill (or the earlier request's).
    full = (len(prompt) - 1) // bm.block_size * bm.block_size
    assert bm.prefix_cache_queries - queries == 3 * len(prompt)
    assert bm.prefix_cache_hits - hits == 3 * full


def test_n_sampled_choices_differ_and_a_seed_reproduces_them(engine, prompt):
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=7)
    first = run(engine, "s1", prompt, params)
    again = run(engine, "s2", prompt, SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=7))
    texts = [first[i].new_token_ids for i in range(3)]
    assert len({tuple(t) for t in texts}) == 3, texts
    assert texts == [again[i].new_token_ids for i in range(3)]


def test_logprobs_match_a_direct_log_softmax_and_top1_is_the_greedy_token(engine, prompt):
    out = run(engine, "lp", prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=5))[0]
    assert len(out.logprobs) == len(out.new_token_ids) == 8
    reference = direct_logprobs(engine, prompt + out.new_token_ids)
    for i, (token_id, entry) in enumerate(zip(out.new_token_ids, out.logprobs, strict=True)):
        row = reference[len(prompt) - 1 + i]
        assert entry.token_id == token_id and entry.top[0][0] == token_id and len(entry.top) == 5
        assert entry.logprob == pytest.approx(row[token_id].item(), abs=2e-3)
        values, ids = row.topk(5)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=2e-3)


def test_prompt_logprobs_score_every_prompt_token(engine, prompt):
    out = run(engine, "echo", prompt, SamplingParams(temperature=0, max_tokens=2, logprobs=0, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    reference = direct_logprobs(engine, prompt)
    for p, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[p]
        assert entry.logprob == pytest.approx(reference[p - 1, prompt[p]].item(), abs=2e-3)
        assert len(entry.top) == 2
    assert all(entry.top == () for entry in out.logprobs)  # logprobs=0: the sampled token's only


def test_logit_bias_bans_and_forces_tokens(engine, prompt):
    greedy = run(engine, "g", prompt, SamplingParams(temperature=0, max_tokens=4))[0].new_token_ids
    banned = run(engine, "ban", prompt, SamplingParams(temperature=0, max_tokens=4, logit_bias={greedy[0]: -100}))
    assert banned[0].new_token_ids[0] != greedy[0]
    forced_id = engine.tokenizer.encode(" blue")[0]
    forced = run(engine, "force", prompt, SamplingParams(temperature=0, max_tokens=3, logit_bias={forced_id: 100}))
    assert forced[0].new_token_ids == [forced_id] * 3


def test_abort_ends_every_choice_with_exact_counts(engine, prompt):
    engine.add_request("ab", prompt, SamplingParams(temperature=0, max_tokens=50, n=2))
    for _ in range(4):
        engine.step()
    generated = sum(seq.num_output_tokens for seq in engine.output_processor.requests["ab"].choices)
    assert generated > 0
    outs = engine.abort_request("ab")
    assert [o.index for o in outs] == [0, 1] and [o.finished for o in outs] == [False, True]
    assert all(o.finish_reason == "abort" for o in outs)
    assert outs[-1].num_output_tokens == generated
    assert not engine.output_processor.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.abort_request("ab") == []
