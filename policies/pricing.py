"""What a request costs at its pool's prices (config: price_input_per_1m / price_output_per_1m /
price_cached_per_1m, USD per million tokens).

Costs are integer micro-USD, so spend budgets settle exactly like token budgets. A price in USD per 1M tokens is
a price in micro-USD per token, so a cost is just tokens x price, rounded up to the micro-dollar.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

# USD per 1M tokens: about 10,000x the dearest model's price today, yet a whole context at it stays an exact integer
# in a float (2**53 micro-USD), where inf or 1e308 would overflow the cost maths on every request.
MAX_PRICE_PER_1M = 1e6


def price_error(value: object) -> str | None:
    """Why `value` cannot be a price in USD per 1M tokens (None: it can)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_PRICE_PER_1M:
        return f"expected a number from 0 to {MAX_PRICE_PER_1M:.0f} (USD per 1M tokens), got {value!r}"
    return None


@dataclass(frozen=True, slots=True)
class Prices:
    input_per_1m: float = 0.0
    output_per_1m: float = 0.0
    cached_per_1m: float | None = None  # None: cached prompt tokens cost the input price

    def __post_init__(self) -> None:
        for name in ("input_per_1m", "output_per_1m", "cached_per_1m"):
            value = getattr(self, name)
            if value is not None and (error := price_error(value)) is not None:
                raise ValueError(f"{name}: {error}")

    def cost_micros(self, prompt: int, completion: int, cached: int = 0) -> int:
        """The cost of a finished request: cached prompt tokens at the cached price, the rest at the input price."""
        cached = max(0, min(cached, prompt))
        cached_price = self.input_per_1m if self.cached_per_1m is None else self.cached_per_1m
        exact = (prompt - cached) * self.input_per_1m + cached * cached_price + completion * self.output_per_1m
        return math.ceil(exact - 1e-9)

    def max_cost_micros(self, prompt: int, max_tokens: int) -> int:
        """What admission holds on spend budgets: every prompt token at the higher of the input prices (the
        cached share is unknown before the upstream answers) and all of max_tokens."""
        top = max(self.input_per_1m, self.cached_per_1m or 0.0)
        return math.ceil(prompt * top + max_tokens * self.output_per_1m - 1e-9)


def max_cost_over(prices: Iterable[Prices | None], prompt: int, max_tokens: int) -> int:
    """What admission holds when any of several pools may serve the request (its route plan's fallbacks), each
    billing at its own prices: the dearest pool's bound (an unpriced pool costs 0)."""
    return max((p.max_cost_micros(prompt, max_tokens) for p in prices if p is not None), default=0)


def micros_to_usd(micros: int) -> float:
    return round(micros / 1_000_000, 6)
