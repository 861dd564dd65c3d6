"""Length caps: the effective max_tokens and each too_long error, with the numbers in it."""

import pytest

from tokenweir.policies.caps import apply_caps


def test_requested_within_all_caps_is_kept():
    r = apply_caps(100, 50, max_prompt_tokens=1000, max_output_tokens=200, context_window=2048)
    assert r.ok and r.max_tokens == 50


def test_missing_request_takes_the_team_cap():
    assert apply_caps(100, None, max_output_tokens=200, context_window=2048).max_tokens == 200


def test_missing_request_and_cap_takes_what_the_context_leaves():
    assert apply_caps(2000, None, context_window=2048).max_tokens == 48


def test_request_beyond_the_context_is_clamped():
    assert apply_caps(2000, 500, max_output_tokens=1000, context_window=2048).max_tokens == 48


def test_nothing_bounds_it():
    r = apply_caps(10, None)
    assert r.ok and r.max_tokens is None


def test_prompt_over_team_cap():
    r = apply_caps(1001, 10, max_prompt_tokens=1000, context_window=4096)
    assert not r.ok and r.max_tokens is None
    e = r.error
    assert (e.reason, e.what, e.value, e.limit, e.param) == ("too_long", "prompt", 1001, 1000, "messages")
    assert "1001" in e.message and "1000" in e.message


def test_prompt_exactly_at_team_cap_passes():
    assert apply_caps(1000, 10, max_prompt_tokens=1000).ok


@pytest.mark.parametrize("prompt", [2048, 5000])
def test_prompt_filling_the_context(prompt):
    e = apply_caps(prompt, None, context_window=2048).error
    assert (e.what, e.value, e.limit, e.param) == ("context", prompt, 2048, "messages")
    assert "2048" in e.message


def test_prompt_one_short_of_context_may_generate_one():
    assert apply_caps(2047, 100, context_window=2048).max_tokens == 1


def test_requested_over_team_output_cap():
    e = apply_caps(10, 201, max_output_tokens=200, context_window=2048).error
    assert (e.what, e.value, e.limit, e.param) == ("max_tokens", 201, 200, "max_tokens")
    assert "201" in e.message and "200" in e.message


def test_prompt_error_wins_over_max_tokens_error():
    e = apply_caps(5000, 9999, max_prompt_tokens=100, max_output_tokens=10).error
    assert e.what == "prompt"
