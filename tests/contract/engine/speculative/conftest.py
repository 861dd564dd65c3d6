"""The speculative-decoding tests' engines, one of each per test module (module scope): plain decoding, prompt
lookup, the n-gram cache, a draft model, and plain decoding's greedy reference. The tests are in three files so that
the suite's workers run the two 56-prompt comparisons and the rest side by side."""

from dataclasses import replace

import pytest

from tests.support.speculative import ENGINE, PROMPTS, SPEC, counted, greedy
from tokenweir.common.text.model_files import default_model_path
from tokenweir.engine.llm import LLM


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(default_model_path(), **ENGINE)


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


@pytest.fixture(scope="module")
def plain_greedy(plain) -> list[list[int]]:
    """Plain decoding's greedy tokens for PROMPTS, all batched: the reference for each prompt alone too, since the
    engines run batch-invariant kernels (a row's tokens do not depend on its batch;
    tests/contract/engine/test_batch_invariant_cpu.py checks that on its own)."""
    return [o.new_token_ids for o in plain.generate(PROMPTS, greedy())]
