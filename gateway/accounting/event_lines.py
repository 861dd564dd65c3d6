"""The event log's lines as start-up reads them (`last_seq`, `replay_after` in gateway/accounting/events.py): the
fields it reads of an event, with the types it takes; a line of another shape, or torn by a crash mid-write (it
carries no complete bill), is set aside in `<events path>.quarantine` (gateway/accounting/quarantine.py) and the
others are read on. A line without a seq (an older writer's) is read as seq 0."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenweir.gateway.accounting.quarantine import NUMBER, Fields, quarantine_path, read_lines, wrong_field

# What start-up reads of an event: its seq, and what replay_usage (gateway/app.py) adds to usage.
READ_AT_START: Fields = {
    "seq": (int, None),
    "ts": NUMBER,
    "team": (str, None),
    "model": (str, None),
    "served_model": (str, None),
    "route": (list, None),
    "upstream_request_id": (str, None),
    "key_id": (str, None),
    "user": (str, None),
    "prompt_tokens": (int, None),
    "completion_tokens": (int, None),
    "cached_tokens": (int, None),
    "cost": (*NUMBER, None),
}


def unusable(event: Any) -> str | None:
    """Why start-up cannot use this decoded line; None when it can."""
    why = wrong_field(event, READ_AT_START)
    if why is None and event.get("route") and event.get("team") and not (event.get("served_model") or event["model"]):
        return "a served request's event names no model"
    return why


def event_lines(path: Path, events_path: Path) -> Iterator[dict]:
    """The usable events of `path` (the event log at `events_path` or one of its rotated files), in file order."""
    return read_lines(path, unusable, quarantine_path(events_path))
