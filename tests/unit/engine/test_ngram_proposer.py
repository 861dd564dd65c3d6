"""Prompt lookup (engine/spec_decode/ngram_proposer.py) against a plain Python search written from its definition: the
longest n in [min, max] whose last-n tokens occur earlier, the latest such occurrence, up to k tokens after it; and
its pause for a sequence whose drafts keep failing."""

import random

from tokenweir.engine.config import SpeculativeConfig
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.spec_decode.ngram_cache import NgramCache
from tokenweir.engine.spec_decode.ngram_proposer import NgramProposer


def reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first; it must end before the last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_lookup_equals_the_plain_search_on_random_and_repetitive_sequences():
    rng = random.Random(7)
    for trial in range(600):
        vocab = rng.choice([3, 5, 50, 70000])  # small vocabularies repeat a lot; 70000 needs all four bytes
        length = rng.randint(1, 80)
        tokens = [rng.randrange(vocab) for _ in range(length)]
        k, lo = rng.randint(1, 6), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        proposer = NgramProposer(
            SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)
        )
        seq = Sequence(f"s{trial}", tokens, SamplingParams())
        assert proposer.propose(seq, 16) == reference(tokens, k, lo, hi), (tokens, k, lo, hi)
        for _ in range(3):  # the packed copy follows the sequence as it grows
            seq.append_token(rng.randrange(vocab))
            assert proposer.propose(seq, 16) == reference(seq.token_ids, k, lo, hi)


def test_a_match_across_token_boundaries_is_not_taken():
    # packed little-endian, [256, 0] contains the bytes of [1] shifted by one byte; only whole tokens may match
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1))
    seq = Sequence("s", [256, 0, 9, 1], SamplingParams())
    assert proposer.propose(seq, 4) == reference([256, 0, 9, 1], 2, 1, 1) == []


def test_max_drafts_caps_the_proposal():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=2))
    seq = Sequence("s", [1, 2, 3, 4, 5, 6, 1, 2], SamplingParams())
    assert proposer.propose(seq, 16) == [3, 4, 5, 6, 1]
    assert proposer.propose(seq, 2) == [3, 4]
    assert proposer.propose(seq, 0) == []


def test_a_sequence_whose_drafts_keep_failing_pauses_then_tries_again():
    config = SpeculativeConfig(num_speculative_tokens=4, min_acceptance=0.25, acceptance_window=8, retry_after=5)
    proposer = NgramProposer(config)
    seq = Sequence("s", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams())
    assert proposer.propose(seq, 16)
    proposer.record(seq, 4, 1)
    assert proposer.propose(seq, 16), "4 proposed is below the window: no verdict yet"
    proposer.record(seq, 4, 0)  # 1 of 8 accepted: under a quarter
    assert proposer.propose(seq, 16) == []
    for _ in range(4):
        seq.append_token(3)
        assert proposer.propose(seq, 16) == []
    seq.append_token(1)  # retry_after tokens later
    assert proposer.propose(seq, 16)
    proposer.record(seq, 4, 1)
    proposer.record(seq, 4, 1)  # 2 of 8: still at the threshold's edge (0.25 * 8 = 2), not under it
    assert proposer.propose(seq, 16)


def test_the_cache_drafts_what_followed_in_earlier_outputs_longest_ngram_first():
    cache = NgramCache(n_min=1, n_max=2, capacity=1000)
    cache.learn([1, 2, 3, 4, 1, 2, 3, 5])  # after (1, 2): 3 twice; after (3,): 4 once, 5 once
    cache.learn([7, 3, 9])  # after (3,): 9 once more; after (7, 3): 9
    assert cache.draft([8, 1, 2], 3) == [3, 4, 1]  # (1, 2) -> 3; (2, 3) -> 4 (first seen of the tie); (3, 4) -> 1
    assert cache.draft([7, 3], 2) == [9]  # (7, 3) -> 9, then (3, 9) and (9,) are unknown
    assert cache.draft([42], 4) == []


def test_the_cache_forgets_the_least_recently_seen_ngrams_past_its_capacity():
    cache = NgramCache(n_min=1, n_max=1, capacity=3)
    cache.learn([1, 2, 3, 4])  # (1,) (2,) (3,)
    cache.learn([1, 9])  # (1,) seen again: (2,) is now the oldest
    cache.learn([5, 6])  # (5,) in, (2,) out
    assert len(cache) == 3
    assert cache.draft([2], 1) == [] and cache.draft([1], 1) in ([2], [9]) and cache.draft([5], 1) == [6]


def test_the_cache_method_learns_from_finished_outputs_where_the_prompt_has_no_match():
    config = SpeculativeConfig(method="ngram_cache", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    proposer = NgramProposer(config)
    first = Sequence("a", [10, 11], SamplingParams())
    for token in [20, 21, 22, 23]:
        first.append_token(token)
    first.finish_reason = "abort"
    proposer.finished(first)  # cut short: not learned
    assert proposer.propose(Sequence("b", [50, 51, 20], SamplingParams()), 8) == []
    first.finish_reason = "stop"
    proposer.finished(first)  # the output with the prompt's last 2 tokens: 10 11 20 21 22 23
    second = Sequence("b", [50, 51, 20], SamplingParams())
    assert proposer.propose(second, 8) == [21, 22, 23]  # nothing in its own tokens: the cache answers
    third = Sequence("c", [20, 30, 20], SamplingParams())
    assert proposer.propose(third, 8) == [30, 20]  # its own tokens first (prompt lookup)
    plain = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2))
    plain.finished(first)
    assert plain.propose(second, 8) == []
