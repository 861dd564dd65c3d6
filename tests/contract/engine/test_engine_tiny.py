"""Greedy tokens of our engine equal HF transformers' on a tiny random Llama: alone, batched with strangers, with
small prefill chunks, with prefix-cache hits, and after forced preemption."""

import random

import pytest
import torch

from tests.support.engine_fixtures import hf_greedy
from tokenweir.engine.llm import LLM
from tokenweir.engine.sched.sampling_params import SamplingParams

MAX_NEW = 12
LENGTHS = (1, 5, 16, 17, 33, 64, 90, 150)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def expected(tiny_hf_model, prompts) -> list[list[int]]:
    return [hf_greedy(tiny_hf_model, p, MAX_NEW) for p in prompts]


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_alone_matches_hf(tiny_model_dir, prompts, expected):
    llm = LLM(tiny_model_dir, dtype="float32", quantization="none", num_kv_blocks=64)
    for prompt, want in zip(prompts, expected, strict=True):
        assert llm.generate([prompt], greedy())[0].new_token_ids == want


def test_batched_with_small_chunks_matches_hf(tiny_model_dir, prompts, expected):
    llm = LLM(
        tiny_model_dir,
        dtype="float32",
        quantization="none",
        num_kv_blocks=128,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )
    outs = llm.generate(prompts, greedy())
    assert [o.new_token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" and o.num_output_tokens == MAX_NEW for o in outs)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_hits_keep_tokens_exact(tiny_model_dir, tiny_hf_model):
    rng = random.Random(3)
    shared = [rng.randrange(3, 256) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(n)] for n in (1, 7, 20, 33)]
    want = [hf_greedy(tiny_hf_model, p, MAX_NEW) for p in prompts]
    llm = LLM(tiny_model_dir, dtype="float32", quantization="none", num_kv_blocks=128, max_num_batched_tokens=24)
    first = llm.generate(prompts[:1], greedy())
    assert first[0].num_cached_tokens == 0
    rest = llm.generate(prompts[1:], greedy())
    assert [o.new_token_ids for o in first + rest] == want
    # The 40 shared tokens span two full 16-token blocks: each later prompt finds them in the cache.
    assert [o.num_cached_tokens for o in rest] == [32, 32, 32]
    bm = llm.engine.block_manager
    assert bm.prefix_cache_hits >= 96 and bm.num_free_blocks == bm.num_blocks


def test_prefix_caching_off_reports_no_cached_tokens(tiny_model_dir, prompts, expected):
    llm = LLM(tiny_model_dir, dtype="float32", quantization="none", num_kv_blocks=128, enable_prefix_caching=False)
    outs = llm.generate([prompts[5], prompts[5]], greedy())
    assert [o.new_token_ids for o in outs] == [expected[5], expected[5]]
    assert [o.num_cached_tokens for o in outs] == [0, 0]


def test_preemption_keeps_tokens_exact(tiny_model_dir, prompts, expected):
    # 24 blocks of 16 tokens cannot hold all eight sequences at once (they need ~40): the scheduler must preempt.
    llm = LLM(
        tiny_model_dir,
        dtype="float32",
        quantization="none",
        num_kv_blocks=24,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    outs = llm.generate(prompts, greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.new_token_ids for o in outs] == expected
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_priority_orders_the_waiting_queue(tiny_model_dir, prompts):
    llm = LLM(tiny_model_dir, dtype="float32", quantization="none", num_kv_blocks=64, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("low", prompts[2], greedy(2), priority=5)
    engine.add_request("high", prompts[3], greedy(2), priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "low"]


def test_request_that_can_never_fit_is_a_clear_error(tiny_model_dir):
    from tokenweir.engine.core.errors import RequestError

    llm = LLM(tiny_model_dir, dtype="float32", quantization="none", num_kv_blocks=4)  # 64 tokens of KV in all
    with pytest.raises(RequestError, match="maximum context length is 64") as err:
        llm.generate([list(range(3, 63))], greedy(10))
    assert err.value.code == "context_length_exceeded"
    assert not llm.engine.has_unfinished_requests()


def test_prefix_cache_queries_count_a_waiting_request_once(tiny_model_dir):
    engine = LLM(tiny_model_dir, dtype="float32", quantization="none", num_kv_blocks=8).engine  # 128 tokens of KV
    engine.add_request("big", list(range(3, 103)), greedy(20))  # 7 blocks, then 8
    engine.step()
    engine.add_request("waits", list(range(110, 150)), greedy(1))  # needs 3 blocks: none until "big" is done
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps > 10, "the second request waited while the first one decoded"
    assert engine.block_manager.prefix_cache_queries == 100 + 40
