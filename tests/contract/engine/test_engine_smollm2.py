"""The real default model: our greedy tokens equal HF transformers `generate` on the same GGUF weights, for prompts of
many lengths, alone and all batched together with small prefill chunks, prefix caching on, and under preemption
(prompts started by arrival or shortest first)."""

import pytest
import torch

from tokenweir.common.text.model_files import default_model_path
from tokenweir.engine.core.output import RequestOutput
from tokenweir.engine.llm import LLM
from tokenweir.engine.sched.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
MAX_NEW = 24

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Write a Python function that reverses a string, with a docstring."}],
]
TEXTS = [
    "The",
    "Once upon a time, in a village by the sea, there lived",
    "def fibonacci(n):\n    " + "# compute the n-th Fibonacci number iteratively\n    " * 3,
    " ".join(f"Item {i}: the value is {i * 37 % 101}." for i in range(45)),
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        default_model_path(),
        dtype="float32",
        quantization="none",
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_kv_blocks=256,
    )


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.engine.tokenizer
    out = [tok.encode_chat(c) for c in CHATS] + [tok.encode(t) for t in TEXTS]
    assert len({len(p) for p in out}) == len(out) and max(len(p) for p in out) > 300
    return out


@pytest.fixture(scope="module")
def expected(llm, prompts, smollm2_hf_float32) -> list[list[int]]:
    hf = smollm2_hf_float32
    stop = sorted(llm.engine.stop_token_ids)
    refs = []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=stop[0],
        )
        ids = out[0, len(p) :].tolist()
        refs.append(ids[: next((i + 1 for i, t in enumerate(ids) if t in stop), len(ids))])
    return refs


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def alone(llm, prompts) -> list[RequestOutput]:
    """Each prompt run by itself on the module's engine, which leaves every prompt's blocks in its prefix cache."""
    return [llm.generate([prompt], greedy())[0] for prompt in prompts]


def test_alone(alone, expected):
    assert [o.new_token_ids for o in alone] == expected


def test_batched_chunked_prefix_cached(llm, prompts, expected, alone):
    hits_before = llm.engine.block_manager.prefix_cache_hits
    outs = llm.generate(prompts, greedy())
    assert [o.new_token_ids for o in outs] == expected
    # Every prompt ran alone before (the `alone` fixture): this time their blocks come from the prefix cache.
    assert llm.engine.block_manager.prefix_cache_hits > hits_before
    assert all(o.num_cached_tokens > 0 for o, p in zip(outs, prompts, strict=True) if len(p) > 16)


@pytest.mark.parametrize("policy", ["fcfs", "shortest-prompt"])
def test_under_preemption(prompts, expected, policy):
    small = LLM(
        default_model_path(),
        dtype="float32",
        quantization="none",
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_kv_blocks=40,
        scheduling_policy=policy,
    )
    outs = small.generate(prompts, greedy())
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.scheduler.shortest_prompt_first is (policy == "shortest-prompt")
    assert [o.new_token_ids for o in outs] == expected
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_chat_text_is_the_decoded_tokens(llm, prompts):
    out = llm.generate([prompts[1]], greedy())[0]
    assert out.new_text == llm.engine.tokenizer.decode(out.new_token_ids)
    assert "Paris" in out.new_text
