"""Costs are exact femto-USD, rounded once per report, never once per request (policies.pricing)."""

from __future__ import annotations

import pytest

from tokenweir.policies.pricing import (
    Prices,
    femtos_to_usd,
    max_cost_over,
    split_femtos,
    usd_to_femtos,
)

TINY = 1e-6  # USD per 1M tokens: a 14-token request is worth 1.4e-11 USD


def test_10_000_requests_at_a_tiny_price_sum_within_1_percent_of_the_exact_cost():
    prices = Prices(TINY, TINY)
    exact_usd = 10_000 * 14 * TINY / 1e6  # 1.4e-7 USD
    billed = sum(prices.cost_femtos(10, 4) for _ in range(10_000))
    assert abs(femtos_to_usd(billed) - exact_usd) <= 0.01 * exact_usd
    assert billed == 10_000 * 14 * 1_000  # exactly: 1e-6 USD per 1M tokens is 1,000 femto-USD per token


def test_a_price_is_quantized_once_to_integer_femtos_per_token():
    assert Prices(0.15, 0.6, 0.075).per_token_femtos == (150_000_000, 75_000_000, 600_000_000)
    assert Prices(TINY, 2 * TINY).per_token_femtos == (1_000, 1_000, 2_000)  # no cached price: the input one
    assert Prices(1e-10, 0.0).per_token_femtos == (0, 0, 0)  # finer than 1e-9 USD per 1M: quantized away
    assert Prices(0.15, 0.6) == Prices(0.15, 0.6)  # the derived integers take no part in equality


def test_cached_prompt_tokens_cost_the_cached_price_and_never_more_than_the_prompt():
    prices = Prices(1.0, 2.0, 0.5)  # femto-USD per token: 1e9 input, 5e8 cached, 2e9 output
    assert prices.cost_femtos(100, 10, 40) == 60 * 10**9 + 40 * 5 * 10**8 + 10 * 2 * 10**9
    assert prices.cost_femtos(10, 0, 99) == 10 * 5 * 10**8  # a cached count above the prompt is clipped


def test_the_hold_rounds_up_to_the_micro_dollar_and_covers_the_exact_cost():
    prices = Prices(TINY, TINY)
    assert prices.max_cost_micros(10, 4) == 1  # 14,000 femto-USD held as one whole micro-USD
    assert prices.max_cost_micros(0, 0) == 0
    assert Prices(10.0, 20.0).max_cost_micros(6, 100) == 6 * 10 + 100 * 20  # whole micros stay exact
    assert max_cost_over([None, Prices(0.1, 0.1)], 6, 100) == 11  # 10.6 micro-USD, rounded up once
    for prompt, max_tokens in ((1, 1), (7, 13), (1000, 4096)):
        for p in (Prices(0.15, 0.6, 0.075), Prices(TINY, 3 * TINY), Prices(1e6, 1e6)):
            assert p.max_cost_micros(prompt, max_tokens) * 10**9 >= p.cost_femtos(prompt, max_tokens)


def test_femtos_split_into_whole_micros_and_the_rest_and_render_once():
    assert split_femtos(1_411_300_000_000) == (1411, 300_000_000)
    assert split_femtos(999_999_999) == (0, 999_999_999)
    assert femtos_to_usd(140_000_000) == 1.4e-7  # not rounded to 6 places, where it would read 0


@pytest.mark.parametrize("femtos", [0, 1, 14_000, 140_000_000, 1_800_000_000_000, 123_456_789_012_345, 10**15])
def test_an_events_usd_cost_converts_back_to_the_exact_femtos(femtos):
    assert usd_to_femtos(femtos_to_usd(femtos)) == femtos
