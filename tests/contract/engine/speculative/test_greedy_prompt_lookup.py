"""Speculative decoding by prompt lookup (n-grams of the request's own prompt and output), on the real default model,
gives plain decoding's greedy tokens on 56 prompts (chat, code, JSON, copy-heavy edits, stories), each alone and all
batched with strangers, with chunked prefill and prefix caching on; its drafts really ran (acceptance counted in the
metrics, falling with the draft's position), and every KV block is back in the pool afterwards."""

import pytest

from tests.support.speculative import greedy_tokens_hold

pytestmark = pytest.mark.slow


def test_greedy_tokens_equal_plain_decoding_alone_and_batched_and_the_drafts_ran(spec, plain_greedy):
    greedy_tokens_hold(spec, plain_greedy)
