"""Per-request sampling parameters (OpenAI's fields plus vLLM's usual extras)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context window
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1  # choices, sampled in parallel from one prefill
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (completions' echo)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # an OpenAI response_format (json_object / json_schema) the output must follow
    structured: dict[str, Any] | None = None
    speculative: bool = True  # False: this request never speculates, whatever the engine's setting
    # disaggregated prefill (engine/kv_transfer/params.py): {"do_remote_decode": true} on a prefill hop, the
    # producer's answer on the decode hop
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's cache_salt: the prefix cache's blocks of a salted request are found only by requests with the same salt
    # (common/text/prefix_hash.py), so tenants cannot see each other's hits; the gateway sets one per team
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 20:
                raise ValueError(f"{name} must be in [0, 20], got {getattr(self, name)}")
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            if any(not -100 <= v <= 100 for v in self.logit_bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of an n > 1 request: n = 1, and a seeded request's choices draw from
        seed + index (as vLLM does), so they differ from each other yet each is reproducible."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
