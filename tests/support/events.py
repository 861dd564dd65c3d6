"""Waiting for a request's one event in a gateway's JSONL file (events are written after the answer, by group
commit): the tests that read an event by its request id share this."""

from __future__ import annotations

import time
from pathlib import Path

from tokenweir.gateway.accounting.events import read_events


def the_event(path: str | Path, request_id: str, timeout: float = 5.0) -> dict:
    """The one event of `request_id`, waiting up to `timeout` seconds for it; fails on none or several."""
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in read_events(path) if e["request_id"] == request_id]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, f"expected one event for {request_id}, got {found}"
            return found[0]
        time.sleep(0.02)
