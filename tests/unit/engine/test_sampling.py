"""Sampling semantics on the tiny model: seeds reproduce whatever else is batched, greedy limits, penalties, stops."""

import pytest
import torch

from tokenweir.engine.llm import LLM
from tokenweir.engine.sched.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", quantization="none", num_kv_blocks=128)


PROMPT = [5, 17, 99, 42, 7, 150]


def sample(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 16, "ignore_eos": True, **kw})


def test_seed_reproduces_tokens_alone_and_among_strangers(llm):
    alone = llm.generate([PROMPT], sample(temperature=1.0, seed=1234))[0].new_token_ids
    strangers = [[3] * 9, [200, 201, 202], [77] * 30]
    batch = llm.generate(
        [strangers[0], PROMPT, strangers[1], strangers[2]],
        [sample(temperature=1.0), sample(temperature=1.0, seed=1234), sample(temperature=0.7), sample(temperature=0)],
    )
    assert batch[1].new_token_ids == alone
    other_seed = llm.generate([PROMPT], sample(temperature=1.0, seed=99))[0].new_token_ids
    assert other_seed != alone, "a different seed must give a different draw (16 tokens over 256 ids)"


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate([PROMPT], sample(temperature=0))[0].new_token_ids
    assert llm.generate([PROMPT], sample(temperature=1.5, top_k=1, seed=3))[0].new_token_ids == greedy
    assert llm.generate([PROMPT], sample(temperature=1.5, top_p=1e-6, seed=3))[0].new_token_ids == greedy
    assert llm.generate([PROMPT], sample(temperature=1.5, min_p=1.0, seed=3))[0].new_token_ids == greedy


def test_top_k_restricts_to_the_k_most_likely(llm):
    # With top_k=2 every sampled token must be one of the two greedy-best at its step: replay with the HF-free model.
    out = llm.generate([PROMPT], sample(temperature=2.0, top_k=2, seed=11))[0].new_token_ids
    engine = llm.engine
    context = list(PROMPT)
    for token in out:
        logits = _next_logits(engine, context)
        assert token in logits.topk(2).indices.tolist()
        context.append(token)


def _next_logits(engine, context: list[int]) -> torch.Tensor:
    from tokenweir.engine.sched.scheduler import SchedulerOutput
    from tokenweir.engine.sched.sequence import Sequence

    seq = Sequence("probe", context, SamplingParams(max_tokens=1))
    assert engine.block_manager.allocate_slots(seq, len(context))
    try:
        batch = engine.runner.prepare(SchedulerOutput(prefills=[(seq, len(context))]))
        kv = engine.runner.kv_caches
        return engine.model.forward(batch.input_ids, batch.positions, kv, batch.attention, batch.logits_indices)[0]
    finally:
        engine.block_manager.free(seq)


def test_frequency_penalty_discourages_repeats(llm):
    def repeats(tokens: list[int]) -> int:
        return len(tokens) - len(set(tokens))

    plain = llm.generate([PROMPT], sample(temperature=0, max_tokens=40))[0].new_token_ids
    penalized = llm.generate([PROMPT], sample(temperature=0, max_tokens=40, frequency_penalty=2.0))[0].new_token_ids
    assert repeats(penalized) < repeats(plain)


def test_stop_token_ids_and_max_tokens(llm):
    greedy = llm.generate([PROMPT], sample(temperature=0))[0]
    stop_at = greedy.new_token_ids[3]
    out = llm.generate([PROMPT], sample(temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.new_token_ids == greedy.new_token_ids[: greedy.new_token_ids.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert greedy.finish_reason == "length" and greedy.num_output_tokens == 16


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -5},
        {"min_p": 2},
        {"max_tokens": 0},
        {"n": 0},
        {"logprobs": 21},
        {"logit_bias": {5: 101}},
        {"presence_penalty": 3},
    ],
)
def test_invalid_params_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
