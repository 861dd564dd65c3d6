"""Shared by the speculative-decoding tests (tests/contract/engine/test_speculative*.py, split so that the suite's
workers run them side by side): the speculation settings, the engines' sizes, 56 prompts (chat, code, JSON,
copy-heavy edits, stories), engines whose steps are counted in metrics of their own, and plain decoding's greedy
reference. The fixtures (engines, module scope) are in tests/contract/engine/speculative/conftest.py."""

import json

from tokenweir.common.text.model_files import default_model_path
from tokenweir.engine.config import SpeculativeConfig
from tokenweir.engine.core.metrics import EngineMetrics
from tokenweir.engine.llm import LLM
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.spec_decode.draft_model_proposer import DraftModelProposer

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


def greedy(max_tokens: int = 32, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **extra)


def metric(llm: LLM, name: str) -> float:
    value = llm.engine_metrics.registry.get_sample_value(f"tokenweir:{name}_total", {"model_name": "spec"})  # type: ignore[attr-defined]
    return value or 0.0


def all_blocks_free(llm: LLM) -> bool:
    """Every KV block back in the pool, the draft model's too."""
    pools = [llm.engine.block_manager]
    proposer = llm.engine.speculator.proposer if llm.engine.speculator is not None else None
    if isinstance(proposer, DraftModelProposer):
        proposer.release_finished()
        pools.append(proposer.block_manager)
    full = all(bm.num_free_blocks == bm.num_blocks for bm in pools)
    return full and not llm.engine.has_unfinished_requests()


def greedy_tokens_hold(spec: LLM, reference: list[list[int]]) -> None:
    """Speculation gives plain decoding's greedy tokens for every prompt alone and all batched, drafts ran and were
    accepted and refused, acceptance falls with the draft's position, and every block is back."""
    assert len(PROMPTS) >= 50
    drafts_before = metric(spec, "spec_decode_num_draft_tokens")
    alone = [spec.generate([p], greedy())[0].new_token_ids for p in PROMPTS]
    assert alone == reference
    batched = [o.new_token_ids for o in spec.generate(PROMPTS, greedy())]
    assert batched == reference
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
