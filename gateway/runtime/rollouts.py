"""The rollout controller: each replica judges every alias's rollout on its own traffic (policies/canary.py) and
writes a step, a promotion or a rollback to the store with compare-and-set on the alias's entry, so one replica's
decision wins and every replica applies it at its next routing refresh (within `routing_poll_interval_s`).

What a replica judges is what it served: with N replicas each sees about 1/N of the traffic, so `min_requests` is a
per-replica sample. A breach seen by any replica rolls the canary back everywhere. A rollout started over (a PUT of
its alias) is judged on what came after: its windows are emptied when a replica first sees the new start, and a
request that arrived before then is not counted in them. A canary's pool is healthy while some member of it may take
a request (its circuit closed, or half-open with a probe out; not down, not draining).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from tokenweir.common.logging import get_logger
from tokenweir.gateway.config import AliasConfig, RolloutConfig
from tokenweir.gateway.runtime.routing_sync import RoutingSync, alias_body
from tokenweir.gateway.store.db import DB_ERRORS
from tokenweir.gateway.store.routing import VersionConflict
from tokenweir.gateway.store.store import Store
from tokenweir.gateway.upstream.instance import OPEN
from tokenweir.gateway.upstream.periodic import Periodic
from tokenweir.gateway.upstream.pools import Pool, Upstreams
from tokenweir.policies.canary import PROGRESSING, RolloutState, Summary, Thresholds, Window, advance, restarted

if TYPE_CHECKING:
    from tokenweir.gateway.accounting.metrics import Metrics

log = get_logger()


def append_durably(path: Path, line: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def thresholds(r: RolloutConfig) -> Thresholds:
    return Thresholds(
        r.window_s,
        r.min_requests,
        r.max_error_rate_delta,
        r.max_ttft_p95_ratio,
        r.max_tpot_p95_ratio,
        r.min_ttft_p95_delta_ms,
        r.min_tpot_p95_delta_ms,
    )


def healthy(pool: Pool | None) -> bool:
    """Some member of the pool may take a request: not down, not draining, its circuit not open (closed, or
    half-open with a probe out). False for a pool with no member, or none left in the table."""
    return pool is not None and any(i.circuit != OPEN and not i.cfg.draining for i in pool.serving)


class Rollouts:
    def __init__(
        self,
        upstreams: Upstreams,
        store: Store,
        routing: RoutingSync,
        metrics: Metrics | None = None,
        decisions_path: Path | None = None,
    ) -> None:
        self.upstreams, self.store, self.routing = upstreams, store, routing
        # Each decision this replica wrote, one JSON line (beside the request events, which have a request's shape)
        self.metrics, self.decisions_path = metrics, decisions_path
        # (alias, variant, its pool) -> this replica's recent outcomes: a variant pointed at another pool (a new
        # canary under the same name) starts with an empty window
        self.windows: dict[tuple[str, str, str], Window] = {}
        # alias -> the rollout's state this replica judged last, and when (time.perf_counter, a request's clock) it
        # last saw the rollout start over: requests that arrived before that are the old rollout's
        self.seen: dict[str, RolloutState] = {}
        self.started_at: dict[str, float] = {}
        self.judge = Periodic(self.tick, "rollout_tick_failed", DB_ERRORS)  # the store away: judged again next time

    def observe(
        self,
        alias: str,
        variant: str,
        pool: str,
        ok: bool,
        ttft_s: float | None,
        tpot_s: float | None,
        arrived: float | None = None,
    ) -> None:
        """A finished request of an alias's variant served by `pool`: ok (by the variant's own pool, no error), its
        TTFT and TPOT (None where it has none: a failure, one token); `arrived`: its time.perf_counter() at arrival
        (one that came before its rollout started over is not counted)."""
        declared = self.upstreams.routes.declared.get(alias)
        r = declared.rollout if declared is not None else None
        if r is None or variant not in (r.canary, r.baseline):
            return
        self.follow(alias)
        if arrived is not None and arrived < self.started_at.get(alias, arrived):
            return
        window = self.windows.setdefault((alias, variant, pool), Window(r.window_s))
        window.window_s = r.window_s
        window.add(time.monotonic(), ok, ttft_s, tpot_s)

    def summaries(self, alias: AliasConfig) -> tuple[Summary, Summary]:
        """The canary's and the baseline's windows, now."""
        r = alias.rollout
        assert r is not None
        self.follow(alias.model)
        now = time.monotonic()
        empty = Window(r.window_s)
        canary, baseline = (
            self.windows.get((alias.model, name, alias.variant(name).pool), empty).summary(now, r.min_requests)
            for name in (r.canary, r.baseline)
        )
        return canary, baseline

    async def tick(self) -> None:
        routes = self.upstreams.routes
        for name, alias in routes.declared.items():
            r = alias.rollout
            if r is None:
                continue
            state = routes.rollouts.get(name)
            if state is None:  # a config file's rollout: its start is stored once, so every replica agrees on it
                await self.write(alias, RolloutState(since=time.time()), "started")
                continue
            self.report(alias, state)
            canary, baseline = self.summaries(alias)
            reachable = healthy(routes.pools.get(alias.variant(r.canary).pool))
            nxt = advance(state, r.steps, r.step_s, time.time(), canary, baseline, thresholds(r), reachable)
            if nxt is not None:
                to = nxt.status if nxt.status != PROGRESSING else "step"
                await self.write(alias, nxt, to, canary, baseline)

    def follow(self, alias: str) -> None:
        """Note the alias's rollout state as stored now; one that started over empties the alias's windows."""
        state = self.upstreams.routes.rollouts.get(alias)
        if state is None:  # (none yet, or the rollout removed: a later one starts at step 0 with its own `since`)
            return
        if restarted(self.seen.get(alias), state):
            for key in [k for k in self.windows if k[0] == alias]:
                del self.windows[key]
            self.started_at[alias] = time.perf_counter()
        self.seen[alias] = state

    async def write(
        self,
        alias: AliasConfig,
        state: RolloutState,
        to: str,
        canary: Summary | None = None,
        baseline: Summary | None = None,
    ) -> bool:
        """Store the rollout's new state if the alias's entry is still the one judged; True if this replica's
        write won (then it is applied here at once, and logged, counted and written as an event)."""
        r = alias.rollout
        assert r is not None
        expect = self.upstreams.routes.entry_versions.get(("alias", alias.model), 0)
        try:
            await asyncio.to_thread(self.store.put_routing, "alias", alias.model, alias_body(alias, state), expect)
        except VersionConflict:  # another replica (or an operator) changed it first: take theirs
            await self.routing.refresh(force=True)
            return False
        await self.routing.refresh(force=True)
        share = state.canary_share(r.steps)
        fields: dict[str, object] = {"alias": alias.model, "canary": r.canary, "baseline": r.baseline}
        fields["status"] = state.status
        fields |= {"step": state.step, "canary_share": share, "reason": state.reason}
        if canary is not None and baseline is not None:
            fields |= {"canary_window": canary.to_dict(), "baseline_window": baseline.to_dict()}
        (log.warning if to == "rolled_back" else log.info)("rollout_" + to, **fields)
        if self.metrics is not None:
            self.metrics.rollout_transitions.labels(alias.model, r.canary, to).inc()
        if self.decisions_path is not None:
            line = orjson.dumps({"ts": time.time(), "transition": to, **fields}) + b"\n"
            await asyncio.to_thread(append_durably, self.decisions_path, line)
        return True

    def report(self, alias: AliasConfig, state: RolloutState) -> None:
        if self.metrics is not None and alias.rollout is not None:
            share = state.canary_share(alias.rollout.steps)
            self.metrics.rollout_share.labels(alias.model, alias.rollout.canary).set(share)
