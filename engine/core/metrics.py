"""Prometheus metrics named like vLLM's (`vllm:` -> `tokenweir:`), on a registry of the engine's own.

Fed from the engine thread with stats snapshots (engine/sched/stats.py) and finished sequences, never by reading the
scheduler or the block manager directly.
"""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.sched.stats import SchedulerStats, StepStats

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# vLLM's `vllm:iteration_tokens_total` buckets (tokens per engine step).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_MAX_MODEL_LEN = 2048  # for the token-count buckets when the caller does not say


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, 100, ... while <= max_value."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)


class EngineMetrics:
    def __init__(
        self, model_name: str, registry: CollectorRegistry | None = None, max_model_len: int | None = None
    ) -> None:
        if registry is None:
            # A registry of the engine's own (tests build several engines in one process), plus what the default
            # registry would have exported: process_* (CPU, memory, fds; Linux only), python_info and python_gc_*.
            registry = CollectorRegistry()
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                registry.register(collector)
        self.registry = registry
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenweir:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tokenweir:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"tokenweir:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.num_preemptions = counter("num_preemptions", "Preemptions (recompute) since start.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished (incl. aborted) requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished (incl. aborted) requests.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        self.request_success = Counter(
            "tokenweir:request_success", "Finished requests by reason.", ["model_name", "finished_reason"], registry=r
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between generated tokens.", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.", REQUEST_BUCKETS)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduling to first token.", REQUEST_BUCKETS
        )
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.", REQUEST_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len or DEFAULT_MAX_MODEL_LEN)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished (incl. aborted) request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished (incl. aborted) request.", token_buckets
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed per engine step (prefill + decode).", ITERATION_TOKEN_BUCKETS
        )
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative steps: sequences that checked drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and checked.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter(
            "tokenweir:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among a step's drafts (0 first).",
            ["model_name", "position"],
            registry=r,
        )
        # Token fairness (engine/sched/fairness.py), by the gateway's fairness id: at most MAX_LABELLED_IDS ids by
        # name, the rest summed as "(other)" (every label value is a series Prometheus keeps: a bound keeps a
        # thousand tenants, or a fresh id per request, from flooding it); "(none)": requests without one.
        self.fairness_tokens = Counter(
            "tokenweir:fairness_weighted_tokens",
            "Weighted tokens served per fairness id (prompt tokens computed + output weight x output tokens).",
            ["model_name", "fairness_id"],
            registry=r,
        )
        self.fairness_counter = Gauge(
            "tokenweir:fairness_virtual_counter",
            "The fairness id's virtual token counter (its service, lifted on return from idle); the least-served "
            "waiting id starts next.",
            ["model_name", "fairness_id"],
            registry=r,
        )
        self.kv_pinned_blocks = gauge("kv_transfer_pinned_blocks", "KV blocks pinned for decode engines to fetch.")
        self.kv_pins_served = counter("kv_transfer_served", "Prompts' KV fetched from here by decode engines.")
        self.kv_pins_expired = counter("kv_transfer_expired", "Pinned prompts' KV freed unfetched, at its timeout.")
        self.kv_bytes_sent = counter("kv_transfer_sent_bytes", "KV bytes sent to decode engines.")
        self.kv_fetches = counter("kv_transfer_fetches", "Fetches of a prompt's KV from a prefill engine.")
        self.kv_fetch_failures = counter(
            "kv_transfer_fetch_failures", "Fetches that failed (the prompt was computed here instead)."
        )
        self.kv_bytes_fetched = counter("kv_transfer_received_bytes", "KV bytes fetched from prefill engines.")
        self.kv_fetch_seconds = counter("kv_transfer_fetch_seconds", "Time spent in fetches, in seconds.")
        self.model_name = model_name
        self._last = SchedulerStats()  # the totals already counted

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        """Gauges from a snapshot; counters by what its totals grew since the last one."""
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.num_preemptions.inc(stats.num_preemptions - self._last.num_preemptions)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - self._last.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - self._last.prefix_cache_hits)
        self.kv_pinned_blocks.set(stats.kv_pinned_blocks)
        self._observe_fairness(stats)
        for name in (
            "kv_pins_served",
            "kv_pins_expired",
            "kv_bytes_sent",
            "kv_fetches",
            "kv_fetch_failures",
            "kv_bytes_fetched",
            "kv_fetch_seconds",
        ):
            getattr(self, name).inc(getattr(stats, name) - getattr(self._last, name))
        self._last = stats

    def _observe_fairness(self, stats: SchedulerStats) -> None:
        served = {share.label: share.served for share in self._last.fair_shares}
        for share in stats.fair_shares:
            labels = (self.model_name, share.label)
            self.fairness_tokens.labels(*labels).inc(max(share.served - served.get(share.label, 0.0), 0.0))
            self.fairness_counter.labels(*labels).set(share.counter)

    def observe_step(self, stats: StepStats, now: float) -> None:
        if stats.num_tokens:
            self.iteration_tokens.observe(stats.num_tokens)
        for seq in stats.first_tokens:
            assert seq.first_token_time is not None  # stamped by the step that gave it the token
            self.ttft.observe(seq.first_token_time - seq.arrival_time)
        if stats.step_seconds:
            # A sequence that decoded this step waited one step for its tokens: several when drafts were accepted.
            for num_new in stats.decoded:
                for _ in range(num_new):
                    self.itl.observe(stats.step_seconds / num_new)
        for seq in stats.finished:
            self.observe_finished(seq, now)
        if (spec := stats.spec) is not None and spec.num_drafts:
            self.spec_drafts.inc(spec.num_drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
            for position, accepted in enumerate(spec.accepted_per_pos):
                if accepted:
                    self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(accepted)

    def observe_finished(self, seq: Sequence, now: float) -> None:
        """One finished sequence: a request, or one choice of an n > 1 request, whose prompt counts once (with its
        first choice), as it is computed and billed once."""
        if seq.index == 0:
            self.prompt_tokens.inc(seq.num_prompt_tokens)
            self.request_prompt_tokens.observe(seq.num_prompt_tokens)
        self.generation_tokens.inc(seq.num_output_tokens)
        self.request_generation_tokens.observe(seq.num_output_tokens)
        self.request_success.labels(self.model_name, seq.finish_reason or "abort").inc()
        self.e2e.observe(now - seq.arrival_time)
        if seq.first_scheduled_time is not None:
            self.queue_time.observe(seq.first_scheduled_time - seq.arrival_time)
            if seq.first_token_time is not None:
                self.prefill_time.observe(seq.first_token_time - seq.first_scheduled_time)
                self.decode_time.observe((seq.last_token_time or now) - seq.first_token_time)
