"""Shared by the end-to-end accounting tests that run a gateway `stack` (a dict with its store and event file): a
fresh team with a key, and the team's events once they are written."""

from __future__ import annotations

import time
import uuid

from tokenweir.gateway.accounting.events import read_events
from tokenweir.policies.limits import TeamLimits


def team(stack, limits: TeamLimits | None = None) -> tuple[str, str]:
    store = stack["store"]
    t = store.create_team(f"team-{uuid.uuid4().hex[:10]}", limits or TeamLimits(tokens_per_day=1_000_000))
    secret, _ = store.create_key(t.id, "test")
    return t.id, secret


def events_of(stack, team_id: str, n: int, timeout: float = 10.0) -> list[dict]:
    """The team's events, once there are at least `n` (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        events = [e for e in read_events(stack["events"]) if e["team"] == team_id]
        if len(events) >= n or time.monotonic() > deadline:
            return events
        time.sleep(0.05)
