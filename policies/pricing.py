"""What a request costs at its pool's prices (config: price_input_per_1m / price_output_per_1m /
price_cached_per_1m, USD per million tokens).

Costs are exact integers of femto-USD (1e-15 USD), so a sum of any number of requests is exact and a report rounds
once, when it renders the sum (`femtos_to_usd`), never once per request. A price in USD per 1M tokens x 1e9 is a
price in femto-USD per token; it is rounded to an integer once, when `Prices` is built (a price finer than 1e-9 USD
per 1M tokens is quantized to that step), and a request's cost is then tokens x those integers, exactly.

What admission holds on a spend budget is a bound in whole micro-USD rounded up (`max_cost_micros`): conservative
for a hold, and the settle gives back what the exact cost did not use. Budgets and usage rows keep whole micro-USD
plus the femto-USD below a micro-dollar (`split_femtos`), so their sums fit int64 and stay exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal

# USD per 1M tokens: about 10,000x the dearest model's price today, yet bounded, where inf or 1e308 would overflow
# the cost maths on every request (at this price a token costs 1e15 femto-USD, a whole context an exact Python int).
MAX_PRICE_PER_1M = 1e6

FEMTOS_PER_MICRO = 10**9
FEMTOS_PER_USD = 10**15
# USD per 1M tokens -> femto-USD per token: 1e-6 USD per token is 1e9 femto-USD per token.
_FEMTOS_PER_TOKEN_AT_1_USD_PER_1M = 10**9


def price_error(value: object) -> str | None:
    """Why `value` cannot be a price in USD per 1M tokens (None: it can)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_PRICE_PER_1M:
        return f"expected a number from 0 to {MAX_PRICE_PER_1M:.0f} (USD per 1M tokens), got {value!r}"
    return None


def _femtos_per_token(usd_per_1m: float) -> int:
    return round(usd_per_1m * _FEMTOS_PER_TOKEN_AT_1_USD_PER_1M)


@dataclass(frozen=True, slots=True)
class Prices:
    """A pool's prices in USD per 1M tokens, quantized once to integer femto-USD per token (1e-9 USD per 1M)."""

    input_per_1m: float = 0.0
    output_per_1m: float = 0.0
    cached_per_1m: float | None = None  # None: cached prompt tokens cost the input price
    # femto-USD per token (input, cached, output): the integers every cost is computed with
    per_token_femtos: tuple[int, int, int] = field(init=False, repr=False, compare=False, default=(0, 0, 0))

    def __post_init__(self) -> None:
        for name in ("input_per_1m", "output_per_1m", "cached_per_1m"):
            value = getattr(self, name)
            if value is not None and (error := price_error(value)) is not None:
                raise ValueError(f"{name}: {error}")
        cached = self.input_per_1m if self.cached_per_1m is None else self.cached_per_1m
        per_token = tuple(_femtos_per_token(p) for p in (self.input_per_1m, cached, self.output_per_1m))
        object.__setattr__(self, "per_token_femtos", per_token)

    def cost_femtos(self, prompt: int, completion: int, cached: int = 0) -> int:
        """The exact cost of a finished request in femto-USD: cached prompt tokens at the cached price, the rest at
        the input price. No rounding: sums of these are exact."""
        cached = max(0, min(cached, prompt))
        input_price, cached_price, output_price = self.per_token_femtos
        return (prompt - cached) * input_price + cached * cached_price + completion * output_price

    def max_cost_micros(self, prompt: int, max_tokens: int) -> int:
        """What admission holds on spend budgets, in micro-USD rounded up: every prompt token at the higher of the
        input prices (the cached share is unknown before the upstream answers) and all of max_tokens."""
        input_price, cached_price, output_price = self.per_token_femtos
        return femtos_to_micros_up(prompt * max(input_price, cached_price) + max_tokens * output_price)


def max_cost_over(prices: Iterable[Prices | None], prompt: int, max_tokens: int) -> int:
    """What admission holds when any of several pools may serve the request (its route plan's fallbacks), each
    billing at its own prices: the dearest pool's bound (an unpriced pool costs 0)."""
    return max((p.max_cost_micros(prompt, max_tokens) for p in prices if p is not None), default=0)


def split_femtos(femtos: int) -> tuple[int, int]:
    """(whole micro-USD, the femto-USD below a micro-dollar): how budgets and usage rows store an exact cost."""
    return divmod(femtos, FEMTOS_PER_MICRO)


def femtos_to_micros_up(femtos: int) -> int:
    """Whole micro-USD covering `femtos`: a hold, which must never be less than the cost."""
    return -(-femtos // FEMTOS_PER_MICRO)


def femtos_to_usd(femtos: int) -> float:
    """An exact sum rendered in USD: the one rounding it gets (to the nearest float; int / int is correctly
    rounded). Not to 6 places: a sum of tiny costs must not read as 0."""
    return femtos / FEMTOS_PER_USD


def usd_to_femtos(usd: float) -> int:
    """Back from a rendered USD value (an event's `cost`) to femto-USD: exact for every value `femtos_to_usd` made
    of up to 1e15 femto-USD (its shortest repr is the exact decimal), within a float's precision above."""
    return int(Decimal(repr(float(usd))).scaleb(15).to_integral_value())
