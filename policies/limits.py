"""A team's and an API key's limits as plain data, shared by the store, the admission policies and the state backends.

Both are "subjects" the state backends count the same way (rpm, tpm, day / month token and spend budgets); a key is
counted beside its team in one atomic reserve, so the tighter of the two wins (and a key's spend is counted even
without limits of its own, so one added mid-period starts from what it already spent).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

# Priority bands: lower runs first (vLLM semantics); a band never dispatches while a lower band waits.
PRIORITY_CRITICAL = 0
PRIORITY_STANDARD = 1
PRIORITY_BATCH = 2


@dataclass(frozen=True)
class TeamLimits:
    """None means unlimited (or, for timeouts, the gateway default)."""

    rpm: int | None = None
    tpm: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    max_concurrency: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    allowed_models: tuple[str, ...] | None = None
    priority: int = PRIORITY_STANDARD
    weight: int = 1
    queue_timeout_s: float | None = None
    ttft_timeout_s: float | None = None
    total_timeout_s: float | None = None
    usd_per_day: float | None = None  # spend budgets, in USD at the pools' prices (config: price_*_per_1m)
    usd_per_month: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.allowed_models is not None:
            d["allowed_models"] = list(self.allowed_models)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TeamLimits:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if kwargs.get("allowed_models") is not None:
            kwargs["allowed_models"] = tuple(kwargs["allowed_models"])
        return cls(**kwargs)

    def allows_model(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


@dataclass(frozen=True)
class KeyLimits:
    """One API key's own limits, enforced together with its team's. None means no limit of the key's own."""

    rpm: int | None = None
    tpm: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    usd_per_day: float | None = None
    usd_per_month: float | None = None
    max_concurrency: int | None = None
    allowed_models: tuple[str, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.allowed_models is not None:
            d["allowed_models"] = list(self.allowed_models)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KeyLimits:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if kwargs.get("allowed_models") is not None:
            kwargs["allowed_models"] = tuple(kwargs["allowed_models"])
        return cls(**kwargs)

    def allows_model(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


def usd_micros(usd: float | None) -> int | None:
    """A spend budget as the state backends count it: integer micro-USD (None: unlimited)."""
    return None if usd is None else round(usd * 1_000_000)
