"""A team's limits as plain data, shared by the store, the admission policies and the state backends."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

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

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.allowed_models is not None:
            d["allowed_models"] = list(self.allowed_models)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> TeamLimits:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if kwargs.get("allowed_models") is not None:
            kwargs["allowed_models"] = tuple(kwargs["allowed_models"])
        return cls(**kwargs)

    def allows_model(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models
