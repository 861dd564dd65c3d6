"""What the engine reports about itself: `SchedulerStats`, a snapshot of the queues and the KV pool, and `StepStats`,
what one step did. Metrics and GET /load read these, never the scheduler's or the block manager's internals."""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass, field

from tokenweir.engine.sched.fairness import FairShare
from tokenweir.engine.sched.sequence import Sequence


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
    # token fairness: per fairness id (a bounded set of labels), weighted tokens served in all and the counter now
    fair_shares: tuple[FairShare, ...] = ()
    # disaggregated prefill: what a producer pins and serves, what a consumer fetches (LLMEngine.make_stats)
    kv_pinned_blocks: int = 0
    kv_pins_served: int = 0
    kv_pins_expired: int = 0
    kv_bytes_sent: int = 0
    kv_fetches: int = 0
    kv_fetch_failures: int = 0
    kv_bytes_fetched: int = 0
    kv_fetch_seconds: float = 0.0


@dataclass
class SpecDecodingStats:
    """One step's speculative decoding, in vLLM's terms: drafts (sequences that checked drafts), draft tokens,
    accepted tokens, and accepted tokens per draft position (position i counts the drafts accepted at i)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_draft_tokens <= self.num_spec_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


@dataclass
class StepStats:
    """What one step did, for metrics."""

    num_generation_tokens: int = 0
    spec: SpecDecodingStats | None = None  # None: speculative decoding is off
    num_tokens: int = 0  # tokens the model computed this step (prefill chunks + decodes)
    first_tokens: list[Sequence] = field(default_factory=list)  # sequences that got their first token
    decoded: list[int] = field(default_factory=list)  # per sequence that got later tokens: how many
    finished: list[Sequence] = field(default_factory=list)
    step_seconds: float = 0.0


class PrefixCacheLog:
    """What GET /load tells routers about the prefix cache: how many blocks it holds, and the hashes it evicted,
    numbered by a sequence that only grows. Written by the block manager on the engine thread, read by /load on the
    event loop, hence the lock (taken only when a cached block is registered or evicted, and by a reader).

    Several pollers (gateway replicas) each ask `since(seq)` with the last sequence number they saw; the log keeps
    the newest `capacity` evictions, and a poller that fell further behind learns it (`complete` False) and may
    drop what it knew of this instance instead of keeping stale entries."""

    def __init__(self, capacity: int = 4096) -> None:
        self._lock = threading.Lock()
        self._ring: deque[int] = deque(maxlen=capacity)
        self.epoch = uuid.uuid4().hex[:16]  # this process's log: a poller that sees another one starts afresh
        self.seq = 0  # evictions so far; the ring holds numbers seq - len(ring) + 1 .. seq
        self.num_cached_blocks = 0  # blocks registered in the prefix cache (in use or free but reusable)

    def cached(self) -> None:
        with self._lock:
            self.num_cached_blocks += 1

    def evicted(self, block_hash: int) -> None:
        with self._lock:
            self.num_cached_blocks -= 1
            self.seq += 1
            self._ring.append(block_hash)

    def since(self, seq: int | None, limit: int | None = None) -> tuple[int, list[int], bool]:
        """(latest sequence number, hashes evicted after `seq` (oldest first, at most `limit`, the newest kept),
        whether that is all of them). `seq` None: nothing (a poller's first call learns where the log stands)."""
        with self._lock:
            latest = self.seq
            if seq is None or seq >= latest:
                return latest, [], seq is None or seq == latest
            missed = latest - seq
            kept = min(missed, len(self._ring))
            hashes = list(self._ring)[len(self._ring) - kept :] if kept else []
        complete = kept == missed
        if limit is not None and len(hashes) > limit:
            hashes, complete = hashes[len(hashes) - limit :], False
        return latest, hashes, complete
