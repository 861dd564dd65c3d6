"""What the engine reports about itself: `SchedulerStats`, a snapshot of the queues and the KV pool, and `StepStats`,
what one step did. Metrics and GET /load read these, never the scheduler's or the block manager's internals."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass(frozen=True)
class SchedulerStats:
    """Filled by `Scheduler.make_stats()` on the engine thread; frozen, so the event loop may read a published one."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use (0-1)
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_cached_free_blocks: int = 0  # free, but still holding a reusable prefix
    # Totals since start; metrics turn them into counter increments.
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up, once per request (at its first scheduling)
    prefix_cache_hits: int = 0  # of those, tokens found in the cache


@dataclass
class StepStats:
    """What one step did, for metrics."""

    num_generation_tokens: int = 0
    num_tokens: int = 0  # tokens the model computed this step (prefill chunks + decodes)
    first_tokens: list[Sequence] = field(default_factory=list)  # sequences that got their first token
    finished: list[Sequence] = field(default_factory=list)
    step_seconds: float = 0.0
