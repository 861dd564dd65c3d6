"""Prometheus metrics on a per-app CollectorRegistry (so apps in tests never collide)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenweir.gateway.accounting.event_faults import WriteFaults


class _CachedLabels:
    """`labels(*values)` through a plain dict. prometheus_client's own validates the values, converts each to str
    and takes a lock on every call: a dozen such calls per request were a visible part of the gateway's CPU. The
    child is the library's own (made on the first call for these values); `remove` and `clear` forget it here too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._label_cache: dict[tuple, Any] = {}
        super().__init__(*args, **kwargs)

    def labels(self, *values: Any, **kwargs: Any) -> Any:
        if kwargs:
            return super().labels(*values, **kwargs)  # type: ignore[misc]
        child = self._label_cache.get(values)
        if child is None:
            child = self._label_cache[values] = super().labels(*values)  # type: ignore[misc]
        return child

    def remove(self, *values: Any) -> None:
        self._label_cache.clear()
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self._label_cache.clear()
        super().clear()  # type: ignore[misc]


class Counter(_CachedLabels, prometheus_client.Counter):
    pass


# Length buckets of the latency histograms' prompt_len / output_len labels: (upper bound in tokens, label)
PROMPT_BUCKETS = ((256, "0-256"), (1024, "256-1k"), (4096, "1k-4k"))
OUTPUT_BUCKETS = ((64, "0-64"), (256, "64-256"), (1024, "256-1k"))


def length_bucket(tokens: int, buckets: tuple[tuple[int, str], ...]) -> str:
    for bound, label in buckets:
        if tokens <= bound:
            return label
    return buckets[-1][1].split("-")[1] + "+"


class Gauge(_CachedLabels, prometheus_client.Gauge):
    pass


class Histogram(_CachedLabels, prometheus_client.Histogram):
    pass


_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_OVERHEAD = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "tokenweir_gateway_"
        self.requests = Counter(p + "requests", "Requests by outcome", ["team", "model", "status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Billed prompt tokens", ["team", "model"], registry=r)
        self.completion_tokens = Counter(
            p + "completion_tokens", "Billed completion tokens", ["team", "model"], registry=r
        )
        self.rejections = Counter(p + "rejections", "Requests shed by reason", ["reason"], registry=r)
        # /v1/batches lines by how they ended: completed (2xx), failed (answered otherwise), or never answered:
        # budget_exhausted, batch_expired, batch_cancelled, interrupted (in flight when its replica died)
        self.batch_lines = Counter(p + "batch_lines", "Batch lines ended, by outcome", ["outcome"], registry=r)
        self.direct_bills = Counter(
            p + "direct_bills",
            "Requests whose event or in-flight journal line could not be written (a full disk), billed straight to "
            "the store (stored), or not (failed: the store failed too; kept in memory, a JSON answer refused 503)",
            ["result"],
            registry=r,
        )
        self.in_flight = Gauge(p + "in_flight", "Requests being served upstream", ["model"], registry=r)
        self.queue_time = Histogram(
            p + "queue_seconds", "Time in the dispatch queue", ["model"], buckets=_LATENCY, registry=r
        )
        # Latency by slice: the request's prompt and output length, each in one of a few fixed buckets
        # (PROMPT_BUCKETS, OUTPUT_BUCKETS), so "is it slower on long prompts?" is one query.
        sliced = ["model", "prompt_len", "output_len"]
        self.ttft = Histogram(p + "ttft_seconds", "Time to first token", sliced, buckets=_LATENCY, registry=r)
        self.tpot = Histogram(
            p + "tpot_seconds", "Time per output token after the first", sliced, buckets=_LATENCY, registry=r
        )
        self.e2e = Histogram(p + "e2e_seconds", "End-to-end request latency", sliced, buckets=_LATENCY, registry=r)
        self.errors = Counter(
            p + "request_errors",
            "Admitted requests that did not end ok, by class (status error | timeout | cancelled, and its reason)",
            ["model", "status", "reason"],
            registry=r,
        )
        self.cost = Counter(
            p + "cost_usd", "Billed cost in USD at the serving pool's prices", ["team", "model"], registry=r
        )
        self.model_info = Gauge(
            p + "model_info",
            "1 per pool member and the model revision it serves (the configured one, else its engine's file digest)",
            ["model", "upstream", "revision"],
            registry=r,
        )
        self.config_info = Gauge(
            p + "config_info", "1 for the configuration this process runs (its digest)", ["digest"], registry=r
        )
        self.config_loaded = Gauge(
            p + "config_loaded_timestamp_seconds",
            "When this process's configuration took effect (the dashboard marks each change)",
            registry=r,
        )
        self.overhead = Histogram(
            p + "overhead_seconds",
            "Wall time spent in the gateway itself (e2e minus queue and upstream time)",
            buckets=_OVERHEAD,
            registry=r,
        )
        self.remaining_budget = Gauge(
            p + "remaining_budget_tokens", "Tokens left in a team's budget", ["team", "period"], registry=r
        )
        self.reserved_tokens = Gauge(
            p + "reserved_tokens", "Tokens held by in-flight reservations", ["team"], registry=r
        )
        self.team_in_flight = Gauge(p + "team_in_flight", "A team's requests in flight", ["team"], registry=r)
        self.queue_depth = Gauge(
            p + "queue_depth", "Requests waiting in a pool's dispatch queue", ["model"], registry=r
        )
        # Per upstream instance (model = the pool it belongs to, upstream = its configured name; not "instance",
        # which Prometheus sets to the scraped gateway itself).
        self.circuit_state = Gauge(
            p + "upstream_circuit_state",
            "An instance's circuit: 0 closed, 1 open, 2 half-open (a probe is out)",
            ["model", "upstream"],
            registry=r,
        )
        self.upstream_failures = Counter(
            p + "upstream_failures",
            "Dispatches that failed on the instance (connect errors, 5xx, 429, broken streams, timeouts)",
            ["model", "upstream"],
            registry=r,
        )
        self.hops = Counter(
            p + "upstream_hops",
            "Hops tried on the instance (every dispatch, fallbacks included)",
            ["model", "upstream"],
            registry=r,
        )
        self.engine_restarts = Counter(
            p + "engine_restarts",
            "Exits of a supervised engine child (`serve --engines N`), each followed by a restart with backoff",
            ["model", "upstream"],
            registry=r,
        )
        self.variant_requests = Counter(
            p + "variant_requests",
            "Requests for an alias by the variant they got and their outcome (the variant's pool labels the rest)",
            ["alias", "variant", "status"],
            registry=r,
        )
        # Rollouts (an alias's canary): its share now, and each step, promotion and rollback
        self.rollout_share = Gauge(
            p + "rollout_canary_share",
            "A rollout's canary share of the alias's subjects, in percent (0 once rolled back)",
            ["alias", "variant"],
            registry=r,
        )
        self.rollout_transitions = Counter(
            p + "rollout_transitions",
            "Rollout decisions this replica wrote: step, promoted, rolled_back",
            ["alias", "variant", "to"],
            registry=r,
        )
        # Shadow traffic (a pool's shadow_pool): mirrored requests by outcome, their latency and tokens (billed to
        # no team), beside the pool's own e2e_seconds for the comparison.
        self.shadow_requests = Counter(
            p + "shadow_requests",
            "Requests mirrored to a shadow pool once answered, by outcome (ok, error, timeout; dropped: too many in "
            "flight to that shadow pool, or the shadow member at its max_parallel_requests; skipped: the request made "
            "no output to mirror)",
            ["model", "shadow", "status"],
            registry=r,
        )
        self.shadow_e2e = Histogram(
            p + "shadow_e2e_seconds", "A mirrored request's latency", ["model", "shadow"], buckets=_LATENCY, registry=r
        )
        self.shadow_tokens = Counter(
            p + "shadow_tokens",
            "Tokens a shadow pool reported for mirrored requests (billed to no team)",
            ["model", "shadow", "kind"],
            registry=r,
        )
        self.retries = Counter(
            p + "retries", "Route plans tried again after every hop failed before its first byte", ["model"], registry=r
        )
        self.fallbacks = Counter(
            p + "fallbacks",
            "Requests for `model` served by a hop of the fallback pool `served_model`",
            ["model", "served_model"],
            registry=r,
        )

        # Disaggregated pools: the prefill hop's time by member, and the requests whose prefill hop failed (their
        # decode member computed the prompt)
        self.prefill_time = Histogram(
            p + "prefill_hop_seconds",
            "A disaggregated pool's prefill hop (its member computing the prompt), by member",
            ["model", "upstream"],
            buckets=_LATENCY,
            registry=r,
        )
        self.prefill_fallbacks = Counter(
            p + "prefill_fallbacks",
            "Requests of a disaggregated pool whose prefill hop failed: the decode member computed the prompt",
            ["model"],
            registry=r,
        )

        # Routing (policies/routing.py): each decision by its reason, and the prefix blocks the pick was expected
        # to hold (0 for a miss) under the prefix strategy. `pool` is the requested model.
        self.routing_decisions = Counter(
            p + "routing_decisions",
            "Route decisions by reason (prefix_hit, prefix_spill, prefix_home, least_loaded, round_robin, ...)",
            ["pool", "reason"],
            registry=r,
        )
        self.routing_prefix_hit_blocks = Histogram(
            p + "routing_prefix_hit_blocks",
            "Prompt prefix blocks the chosen instance was expected to hold (prefix routing)",
            ["pool"],
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )

    def watch_events(self, faults: WriteFaults) -> None:
        """The event log's health, read from its writer at each scrape (gateway/accounting/event_faults.py)."""
        self.registry.register(_EventLogCollector(faults))

    def config_applied(self, digest: str, at: float) -> None:
        self.config_info.clear()
        self.config_info.labels(digest).set(1)
        self.config_loaded.set(at)

    def refresh_team(self, team: str, snapshot: dict) -> None:
        """Copy a state snapshot into the per-team gauges (done at scrape time, not per request)."""
        self.reserved_tokens.labels(team).set(snapshot.get("reserved_tokens", 0) or 0)
        self.team_in_flight.labels(team).set(snapshot.get("in_flight", 0) or 0)
        for period in ("day", "month"):
            left = snapshot.get(f"remaining_{period}")
            if left is None:
                left = (
                    (snapshot.get("remaining") or {}).get(period)
                    if isinstance(snapshot.get("remaining"), dict)
                    else None
                )
            if left is not None:
                self.remaining_budget.labels(team, period).set(left)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EventLogCollector:
    """Whether the event log takes lines, and its failed writes by errno, as its writer's faults say now."""

    def __init__(self, faults: WriteFaults) -> None:
        self.faults = faults

    def collect(self) -> Iterator[Metric]:
        p = "tokenweir_gateway_"
        yield GaugeMetricFamily(
            p + "events_writable",
            "1 while the event log takes lines; 0 while its writes fail (a full disk, an I/O error): requests are "
            "refused 503 events_unavailable until a write or the writer's probe succeeds",
            value=0 if self.faults.fault is not None else 1,
        )
        failed = CounterMetricFamily(
            p + "event_write_failures", "Failed writes of the event log, by errno (ENOSPC, EIO, ...)", labels=["error"]
        )
        for name, n in sorted(self.faults.failed_writes.items()):
            failed.add_metric([name], n)
        yield failed
