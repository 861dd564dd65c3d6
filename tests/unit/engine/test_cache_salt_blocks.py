"""A request's cache_salt keeps its prefix cache its own on the engine: the block manager finds a salted prompt's
blocks only for the same salt (fetched blocks too), the n-gram cache drafts only from the same salt's outputs, and the
wire field reaches the sequence."""

import pytest
from pydantic import ValidationError

from tokenweir.common.text.prefix_hash import block_hashes
from tokenweir.engine.api.protocol import CompletionRequest
from tokenweir.engine.config import SpeculativeConfig
from tokenweir.engine.sched.block_manager import BlockManager
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.spec_decode.ngram_cache import NgramCache
from tokenweir.engine.spec_decode.ngram_proposer import NgramProposer

PROMPT = list(range(100, 150))  # 3 full blocks of 16, then 2 tokens


def seq(request_id: str, salt: str | None, tokens: list[int] = PROMPT) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=4, cache_salt=salt))


def test_a_salted_prompt_is_keyed_by_its_salts_chain_and_found_only_with_that_salt():
    bm = BlockManager(num_blocks=16, block_size=16)
    a = seq("a", "team-a")
    assert bm.allocate_slots(a, a.num_tokens)
    assert a.block_hashes == block_hashes(PROMPT, 16, salt="team-a")  # what the gateway's router computes
    assert bm.find_cached_prefix(seq("b", "team-b")) == []
    assert bm.find_cached_prefix(seq("plain", None)) == []
    assert bm.find_cached_prefix(seq("a2", "team-a")) == a.block_table[:3]


def test_an_unsalted_prompt_keeps_its_hashes_and_is_not_found_by_a_salted_one():
    bm = BlockManager(num_blocks=16, block_size=16)
    plain = seq("plain", None)
    assert bm.allocate_slots(plain, plain.num_tokens)
    assert plain.block_hashes == block_hashes(PROMPT, 16)
    assert bm.find_cached_prefix(seq("s", "any")) == []
    assert len(bm.find_cached_prefix(seq("plain2", None))) == 3


def test_fetched_blocks_enter_the_cache_under_the_requests_salt():
    """A decode hop's blocks, filled from a producer, are registered when it next allocates: by its own chain."""
    bm = BlockManager(num_blocks=16, block_size=16)
    fetched = seq("decode", "team-a")
    assert bm.allocate_for_transfer(fetched, [], len(PROMPT) - 1)
    fetched.num_computed_tokens = len(PROMPT) - 1
    assert bm.allocate_slots(fetched, 1)
    assert fetched.block_hashes == block_hashes(PROMPT, 16, salt="team-a")
    assert bm.find_cached_prefix(seq("b", "team-b")) == []
    assert bm.find_cached_prefix(seq("a", "team-a")) == fetched.block_table[:3]


def test_the_ngram_cache_drafts_only_from_outputs_of_the_same_salt():
    cache = NgramCache(n_min=1, n_max=2, capacity=100)
    cache.learn([1, 2, 3, 4], "team-a")
    assert cache.draft([1, 2], 2, "team-a") == [3, 4]
    assert cache.draft([1, 2], 2, "team-b") == [] and cache.draft([1, 2], 2) == []


def test_the_ngram_proposer_learns_a_finished_output_under_its_requests_salt():
    config = SpeculativeConfig(method="ngram_cache", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    proposer = NgramProposer(config)
    secret = seq("a", "team-a", [10, 11])
    for token in [20, 21, 22, 23]:
        secret.append_token(token)
    secret.finish_reason = "stop"
    proposer.finished(secret)
    assert proposer.propose(seq("b", "team-b", [30, 20]), 8) == []  # team B's guess gets no drafts
    assert proposer.propose(seq("a2", "team-a", [30, 20]), 8) == [21, 22, 23]


def test_the_wire_field_reaches_the_sequence_and_an_empty_salt_is_refused():
    params = CompletionRequest(model="m", prompt=[1, 2, 3], cache_salt="s").sampling_params()
    assert params.cache_salt == "s" and params.for_choice(1).cache_salt == "s"
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).sampling_params().cache_salt is None
    with pytest.raises(ValidationError, match="cache_salt"):
        CompletionRequest(model="m", prompt=[1, 2, 3], cache_salt="")
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")
