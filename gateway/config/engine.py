"""The bundled engine that `tokenweir serve` starts (`engine:`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenweir.gateway.config.base import FAIRNESS, STRICT


@dataclass
class BundledEngineConfig:
    """The bundled engine that `tokenweir serve` starts as a child process."""

    enabled: bool = True
    port: int = 8100
    model_path: str | None = None  # GGUF; default: the bundled SmolLM2
    model_name: str = "smollm2-135m"
    startup_timeout_s: float = 300.0
    extra_args: list[str] = field(default_factory=list)
    # replicas > 1: that many engine children on consecutive free ports from `port`, one pool (route: `route`),
    # each restarted with doubling backoff when it exits (`tokenweir serve --engines N`). 1: one child, as before.
    replicas: int = 1
    # Shared out between the replicas (each gets its part); None: the engine's own default per engine, except
    # that replicas > 1 split the machine's CPUs (num_threads = max(1, cpus // replicas) each).
    num_threads: int | None = None  # torch CPU threads in all
    kv_cache_memory: str | None = None  # KV cache bytes in all (CPU), e.g. "1GiB"
    gpu_memory_utilization: float | None = None  # on CUDA, the GPU's share in all (None: the engine's 0.85)
    restart_backoff_s: float = 0.5  # first wait before a restart; doubles while a replica keeps dying young
    restart_max_backoff_s: float = 30.0
    restart_stable_s: float = 30.0  # a replica that ran this long starts over from restart_backoff_s
    # The bundled pool's route strategy (PoolConfig.route): prefix, least_loaded or round_robin; None: prefix.
    route: str | None = None
    cache_scope: str = "team"  # the bundled pool's PoolConfig.cache_scope: team, key or shared
    capacity: int = 64  # the bundled pool's PoolConfig.capacity: requests dispatched at once, the rest queue
    fairness: str = "tokens"  # the bundled pool's PoolConfig.fairness: tokens, requests or fcfs
    # Disaggregated prefill (`serve --prefill-engines M`): the first M replicas compute prompts (kv_producer, the
    # pool's prefill members), the others fetch their KV and decode (kv_consumer). 0: every replica does both.
    prefill_replicas: int = 0

    __pydantic_config__ = STRICT

    def __post_init__(self) -> None:
        if self.replicas < 1 or (self.num_threads is not None and self.num_threads < 1):
            raise ValueError("engine: replicas >= 1 and num_threads >= 1")
        if not 0 <= self.prefill_replicas < self.replicas and self.prefill_replicas:
            raise ValueError("engine: prefill_replicas leaves at least one of the replicas to decode")
        if self.route is not None and self.route not in ("prefix", "least_loaded", "round_robin"):
            raise ValueError(f"engine.route: expected prefix, least_loaded or round_robin, got {self.route!r}")
        if self.capacity < 1 or self.fairness not in FAIRNESS:
            raise ValueError(f"engine: capacity >= 1, and fairness one of {', '.join(FAIRNESS)}")
        if not 0 < self.restart_backoff_s <= self.restart_max_backoff_s:
            raise ValueError("engine: 0 < restart_backoff_s <= restart_max_backoff_s")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("engine: 0 < gpu_memory_utilization <= 1")

    def role(self, index: int) -> str:
        """The pool role of replica `index`."""
        if not self.prefill_replicas:
            return "both"
        return "prefill" if index < self.prefill_replicas else "decode"
