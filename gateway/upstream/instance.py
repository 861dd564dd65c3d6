"""One upstream instance as the router sees it: its circuit breaker, the load its engine last reported, the model
version it serves, and the gauges and counters it keeps in the metrics.

A failed dispatch counts toward opening its circuit; once open, it takes nothing until its cooldown has passed, then
one request goes as a half-open probe, whose outcome closes or reopens it. An instance whose process is known to be
gone (`mark_down`) stays open, with no probe, until a /load poll answers again (gateway/upstream/load_poll.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenweir.gateway.config import BreakerConfig, UpstreamConfig
from tokenweir.gateway.upstream.prefix_index import PrefixIndex
from tokenweir.policies import routing

if TYPE_CHECKING:
    from tokenweir.gateway.accounting.metrics import Metrics

CLOSED, OPEN, HALF_OPEN = 0, 1, 2  # the circuit-state gauge's values


@dataclass
class Instance:
    cfg: UpstreamConfig
    breaker: BreakerConfig
    in_flight: int = 0
    load: dict | None = None  # last /load answer (our engines only)
    failures: int = 0  # consecutive
    opened_at: float | None = None  # circuit open since (monotonic)
    probing: bool = False  # a half-open probe is out
    model: str = ""  # the pool it belongs to (metrics label)
    metrics: Metrics | None = field(default=None, repr=False, compare=False)
    index: PrefixIndex | None = field(default=None, repr=False, compare=False)  # its pool's (prefix routing)
    evicted_epoch: str | None = None  # where this poller stands in the engine's eviction log (GET /load)
    evicted_seq: int | None = None
    # The process behind it is known to be gone (a supervised engine exited): circuit open, no probe, until a
    # /load poll sent after that answers again (`mark_up`).
    down_since: float | None = None
    max_model_len: int | None = None  # our engine's context length, from its /v1/models (None: not known yet)
    revision: str | None = None  # the model version it serves: configured, else its engine's digest (/load)
    removed: bool = False  # it left a pool that stays (removed, or replaced): nothing new, whatever table routes

    def __post_init__(self) -> None:
        self.revision = self.cfg.revision

    def learn_revision(self, revision: str) -> None:
        """Its engine's model digest, from /load (unless a revision is configured): a new one replaces the old."""
        if self.cfg.revision is not None or revision == self.revision:
            return
        if self.metrics is not None and self.revision is not None:
            self.metrics.model_info.remove(self.model, self.name, self.revision)
        self.revision = revision
        self._report_revision()

    def forget_metrics(self) -> None:
        """It left the routing table: its gauges go (counters stay: a series that stops is what Prometheus expects)."""
        if self.metrics is None:
            return
        with contextlib.suppress(KeyError):
            self.metrics.circuit_state.remove(self.model, self.name)
        if self.revision is not None:
            with contextlib.suppress(KeyError):
                self.metrics.model_info.remove(self.model, self.name, self.revision)

    def _report_revision(self) -> None:
        if self.metrics is not None and self.revision is not None:
            self.metrics.model_info.labels(self.model, self.name, self.revision).set(1)

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def circuit(self) -> int:
        if self.down_since is not None:
            return OPEN
        if self.opened_at is None:
            return CLOSED
        return HALF_OPEN if self.probing else OPEN

    def _report(self) -> None:
        if self.metrics is not None:
            self.metrics.circuit_state.labels(self.model, self.name).set(self.circuit)

    def upstream_model(self, public_model: str) -> str:
        return self.cfg.model or public_model

    def auth_headers(self) -> dict[str, str]:
        """The instance's API key as a bearer header, on every call to it (requests, /abort, /load, /v1/models)."""
        return {"authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    def available(self, now: float) -> bool:
        """Closed circuit; or open past its cooldown with no probe out yet (the caller becomes the probe). Never
        while draining, nor once removed (those it serves finish; it takes no new ones)."""
        if self.down_since is not None or self.cfg.draining or self.removed:
            return False
        if self.opened_at is None:
            return True
        return not self.probing and now - self.opened_at >= self.breaker.cooldown_s

    def take(self, now: float) -> None:
        if self.opened_at is not None:
            self.probing = True
        self.in_flight += 1
        if self.metrics is not None:
            self.metrics.hops.labels(self.model, self.name).inc()
            self._report()

    def done(self, ok: bool, now: float) -> None:
        """Release after a dispatch: `ok` False means a failure of the instance (not of the request)."""
        self.in_flight -= 1
        self.probing = False
        if ok:
            self.failures, self.opened_at = 0, None
        else:
            self.failures += 1
            if self.failures >= self.breaker.failures or self.opened_at is not None:
                self.opened_at = now  # (re)open: a failed half-open probe restarts the cooldown
            if self.metrics is not None:
                self.metrics.upstream_failures.labels(self.model, self.name).inc()
        self._report()

    def mark_down(self, now: float) -> None:
        """Its process exited: open the circuit (no half-open probe while it is down), forget its load and what the
        prefix index says it caches (a restarted engine starts empty)."""
        self.down_since = self.opened_at = now
        self.failures = max(self.failures, self.breaker.failures)
        self.load = self.max_model_len = None  # a restarted engine may serve another length: ask again
        if self.index is not None:
            self.index.forget_instance(self.name)
        self._report()

    def mark_up(self) -> None:
        """Back (its /load answers again): the circuit closes."""
        self.down_since = self.opened_at = None
        self.failures, self.probing = 0, False
        self._report()

    def score(self) -> float:
        """Lower is better. Engines report their queue; for others our own in-flight count is all we know."""
        c = self.candidate(True)
        return routing.load(c) + c.kv_usage

    def candidate(self, available: bool, hit_blocks: int = 0) -> routing.Candidate:
        load = self.load or {}
        return routing.Candidate(
            self.name,
            available=available,
            in_flight=self.in_flight,
            running=int(load.get("num_running", 0) or 0),
            waiting=int(load.get("num_waiting", 0) or 0),
            kv_usage=float(load.get("kv_cache_usage", 0.0) or 0.0),
            hit_blocks=hit_blocks,
            prefix_capable=self.cfg.engine,
        )
