"""The shared state backend's section (`state:`)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenweir.gateway.config.base import STRICT


@dataclass
class StateConfig:
    """The shared state backend (Redis): its connection pool, and what to do while it is unreachable."""

    # state_url names one node of a Redis Cluster (any: the others are found from it). Each team's keys share one hash
    # slot, so every script runs on one primary; MOVED / ASK are followed, and a failover answers as an unreachable
    # state (below) until the replica is promoted. Each node has a pool of max_connections, which raises at once
    # when full (the request path does not use it).
    cluster: bool = False
    max_connections: int = 256  # the pool blocks up to pool_timeout_s for a free connection, never raises at once
    pool_timeout_s: float = 2.0
    timeout_s: float = 2.0  # connect and per-command socket timeout
    # fail_closed: 503 state_unavailable + Retry-After; fail_open: admit under this replica's own limits and
    # write the spend to Redis when it returns.
    on_unavailable: str = "fail_closed"
    retry_after_s: int = 2
    # how often each replica checks that Redis still holds its data (an epoch marker); a loss is repaired within
    # about twice this (gateway.state.repair)
    watch_s: float = 1.0
    # How long a replica that died holds on: its concurrency leases lapse lease_s after it stopped renewing them
    # (every lease_s / 3), its budget holds hold_s after they were taken. A hold must outlive the longest request
    # (else a running request's hold is given back early): null is timeouts.queue_s + timeouts.total_s + 60 s, at
    # least 900 s.
    lease_s: float = 60.0
    hold_s: float | None = None

    __pydantic_config__ = STRICT

    def __post_init__(self) -> None:
        if self.watch_s <= 0:
            raise ValueError(f"state.watch_s: expected a number of seconds > 0, got {self.watch_s!r}")
        if self.lease_s <= 0 or (self.hold_s is not None and self.hold_s <= 0):
            raise ValueError("state: lease_s > 0 and hold_s > 0 (or null)")
        if self.on_unavailable not in ("fail_closed", "fail_open"):
            raise ValueError(f"state.on_unavailable: expected fail_closed or fail_open, got {self.on_unavailable!r}")
        if self.max_connections < 1 or self.pool_timeout_s <= 0 or self.timeout_s <= 0:
            raise ValueError("state: max_connections >= 1, pool_timeout_s > 0 and timeout_s > 0")
