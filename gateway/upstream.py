"""Upstream pools: load-aware instance pick, a circuit breaker per instance, and the route plan of hops.

A hop is (public model, instance). The plan is: the model's pool instances (least loaded first), then each
configured fallback model's instances. The relay tries hops in order while a failure happens BEFORE the first
byte; the hops it tried end up in the request's event as `route`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import orjson

from gateway.config import BreakerConfig, GatewayConfig, PoolConfig, UpstreamConfig
from gateway.http1 import HTTP1Pool, HTTPError

if TYPE_CHECKING:
    from gateway.metrics import Metrics

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

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def circuit(self) -> int:
        if self.opened_at is None:
            return CLOSED
        return HALF_OPEN if self.probing else OPEN

    def _report(self) -> None:
        if self.metrics is not None:
            self.metrics.circuit_state.labels(self.model, self.name).set(self.circuit)

    def upstream_model(self, public_model: str) -> str:
        return self.cfg.model or public_model

    def available(self, now: float) -> bool:
        """Closed circuit; or open past its cooldown with no probe out yet (the caller becomes the probe)."""
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

    def score(self) -> float:
        """Lower is better. Engines report their queue; for others our own in-flight count is all we know."""
        if self.load is None:
            return float(self.in_flight)
        queued = self.load.get("num_running", 0) + 2 * self.load.get("num_waiting", 0)
        return queued + self.in_flight + self.load.get("kv_cache_usage", 0.0)


@dataclass
class Pool:
    cfg: PoolConfig
    instances: list[Instance] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.cfg.model

    def ranked(self, now: float) -> list[Instance]:
        return sorted((i for i in self.instances if i.available(now)), key=Instance.score)


@dataclass
class Hop:
    model: str  # public model name of the pool this hop belongs to
    instance: Instance
    requested: str | None = None  # the model whose route plan this hop is in (another one: a fallback hop)

    @property
    def label(self) -> str:
        return f"{self.model}@{self.instance.name}"

    @property
    def fallback(self) -> bool:
        return self.requested is not None and self.requested != self.model

    def done(self, ok: bool, now: float) -> None:
        """`instance.done`, and a request served (ok) by a fallback pool's hop is counted as a fallback."""
        self.instance.done(ok, now)
        if ok and self.fallback and self.instance.metrics is not None:
            self.instance.metrics.fallbacks.labels(self.requested, self.model).inc()


class Upstreams:
    def __init__(self, config: GatewayConfig, metrics: Metrics | None = None) -> None:
        self.pools: dict[str, Pool] = {}
        for pc in config.pools:
            self.pools[pc.model] = Pool(pc, [Instance(u, config.breaker, model=pc.model) for u in pc.upstreams])
        self.attach_metrics(metrics)
        for pc in config.pools:
            for fb in pc.fallbacks:
                assert fb in self.pools, f"pool {pc.model}: fallback {fb!r} is not a configured pool"
        self.poll_interval_s = config.load_poll_interval_s
        self._poller: asyncio.Task | None = None

    def attach_metrics(self, metrics: Metrics | None) -> None:
        """Per-instance circuit state, failures, hops and fallbacks go to `metrics` from now on."""
        for pool in self.pools.values():
            for inst in pool.instances:
                inst.metrics = metrics
                inst._report()

    def get(self, model: str) -> Pool | None:
        return self.pools.get(model)

    def plan(self, model: str) -> list[Hop]:
        now = time.monotonic()
        pool = self.pools[model]
        hops = [Hop(model, i, model) for i in pool.ranked(now)]
        for fb in pool.cfg.fallbacks:
            hops += [Hop(fb, i, model) for i in self.pools[fb].ranked(now)]
        return hops

    # --- load poller --------------------------------------------------------------------------------------
    def start(self, client: HTTP1Pool) -> None:
        if any(i.cfg.engine for p in self.pools.values() for i in p.instances):
            self._poller = asyncio.create_task(self._poll_forever(client))

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)

    async def _poll_forever(self, client: HTTP1Pool) -> None:
        engines = [i for p in self.pools.values() for i in p.instances if i.cfg.engine]
        while True:
            await asyncio.gather(*(self._poll(client, i) for i in engines))
            await asyncio.sleep(self.poll_interval_s)

    @staticmethod
    async def _poll(client: HTTP1Pool, inst: Instance) -> None:
        try:
            async with asyncio.timeout(2.0):
                r = await client.request("GET", f"{inst.cfg.base_url}/load")
                try:
                    raw = await r.read()
                finally:
                    await r.aclose()
            inst.load = orjson.loads(raw) if r.status_code == 200 else None
        except (HTTPError, TimeoutError, orjson.JSONDecodeError):
            inst.load = None  # unknown load: fall back to in-flight; failures count only on real requests
