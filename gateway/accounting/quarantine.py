"""Start-up's reading of the gateway's own JSONL files (the event log, the in-flight journal, the state outbox): a line
it cannot use is set aside, never a reason to stop.

A line is unusable when it is not JSON (torn by a crash mid-write, or garbage) or not of its file's shape (the
reader's `check`: `[1, 2]`, `null`, `{"seq": "x"}`, a field of the wrong type). `read_lines` yields the usable ones
and appends the others, byte for byte, to `<file>.quarantine` beside the file, each once (the event log is read again
at every start: a line already in quarantine is not added twice), with one warning per file read that set new lines
aside: how many, and why. What is in quarantine is for an operator to read, mend and, where it was a bill, add back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from tokenweir.common.logging import get_logger

log = get_logger()

Check = Callable[[Any], str | None]  # why a decoded line cannot be used; None when it can
NUMBER = (int, float)
Fields = Mapping[str, tuple[type | None, ...]]  # field -> the types it may have (None: it may be null or absent)


def quarantine_path(path: Path) -> Path:
    return path.with_name(path.name + ".quarantine")


def wrong_field(line: Any, fields: Fields) -> str | None:
    """Why `line` is not an object with these fields of these types (a bool is not taken for a number); None if it
    is. Fields not named are not looked at."""
    if not isinstance(line, dict):
        return f"{'null' if line is None else 'a ' + type(line).__name__}, not an object"
    for name, types in fields.items():
        value = line.get(name)
        if value is None:
            if None not in types:
                return f"{name!r} is missing"
            continue
        allowed = tuple(t for t in types if t is not None)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            return f"{name!r} is a {type(value).__name__}"
    return None


def read_lines(path: Path, check: Check, quarantine: Path | None = None) -> Iterator[dict]:
    """The usable lines of `path`, decoded, in file order; the others go to `quarantine` (`<path>.quarantine` by
    default) once the file is read, or the reader stops reading it."""
    unusable: list[tuple[bytes, str]] = []
    try:
        for raw in path.read_bytes().splitlines():
            if not raw.strip():
                continue
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError:
                unusable.append((raw, "not JSON (a line torn by a crash mid-write, or garbage)"))
                continue
            why = check(line)
            if why is None:
                yield line
            else:
                unusable.append((raw, why))
    finally:
        if unusable:
            set_aside(path, quarantine or quarantine_path(path), unusable)


def set_aside(path: Path, quarantine: Path, unusable: list[tuple[bytes, str]]) -> int:
    """Append the lines not in `quarantine` yet; warn once if any were. Returns how many were added. A quarantine
    that cannot be written is logged, never raised: start-up goes on without the lines either way."""
    try:
        known = set(quarantine.read_bytes().splitlines()) if quarantine.exists() else set()
        new = [raw for raw in dict.fromkeys(raw for raw, _ in unusable) if raw not in known]
        if new:
            with quarantine.open("ab") as f:
                f.write(b"".join(raw + b"\n" for raw in new))
    except OSError:
        log.exception("lines_quarantine_failed", file=str(path), quarantine=str(quarantine), lines=len(unusable))
        return 0
    if new:
        reasons = sorted({why for _, why in unusable})
        log.warning(
            "lines_quarantined", file=str(path), quarantine=str(quarantine), lines=len(new), reasons=reasons[:5]
        )
    return len(new)
