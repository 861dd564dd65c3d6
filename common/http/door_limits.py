"""What one HTTP connection may cost the gateway's and the engine's servers before their app sees a request: the
limits (`HttpLimits`, the gateway's `http:` config section and the engine's flags) and the uvicorn options that
enforce them (the protocol classes themselves are common/http/door.py, imported only when a server starts).

Without them, uvicorn (httptools) buffers a request head of any size for as long as the client takes: a few
never-ending headers fill the memory, and slow senders hold connections forever.

Stdlib only: the gateway's config and the engine's `--help` import this without uvicorn.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# h11 (uvicorn's pure-Python parser, used where httptools is missing) refuses a head over its own buffer limit
# with a plain 400; set above ours by one socket read (asyncio reads up to 256 KiB) so that ours answers first.
_READ_SIZE = 256 * 1024


@dataclass
class HttpLimits:
    """Per connection, at the door: a request head bounded in bytes, fields and time; a body that keeps arriving;
    idle connections closed; and a cap on the connections one server process holds."""

    max_header_bytes: int = 64 * 1024  # request line + header fields; over it: 431, connection closed
    max_header_fields: int = 100  # over it: 431
    # The whole head must arrive within this long of the connection opening (first request) or of its first byte
    # (later requests on a kept-alive connection); then 408 and close (a connection that sent nothing: closed).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # longest wait for more of a body the app is reading; then 408 and close
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this long
    # Open connections per server process; one more is answered 503 and closed. With the head and body bounds
    # above, this bounds the memory held by connections (about 130 KiB each at most).
    max_connections: int = 2048
    # A body over this is refused with 413 as it arrives (Content-Length, or counted). None: not here; the
    # gateway's app bounds bodies itself (the top-level `max_body_bytes`), the engine's flag sets one.
    max_body_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_header_bytes < 1024 or self.max_header_fields < 1 or self.max_connections < 1:
            raise ValueError("http: max_header_bytes >= 1024, max_header_fields >= 1 and max_connections >= 1")
        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise ValueError("http: max_body_bytes >= 1 (or null: no bound at the door)")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0 and self.keep_alive_s > 0):
            raise ValueError("http: header_timeout_s, body_timeout_s and keep_alive_s > 0")


def uvicorn_options(limits: HttpLimits) -> dict[str, Any]:
    """Keyword arguments for `uvicorn.Config` / `uvicorn.run` that enforce `limits`."""
    from tokenweir.common.http.door import protocol_class

    return {
        "http": protocol_class(limits),
        "timeout_keep_alive": limits.keep_alive_s,
        "h11_max_incomplete_event_size": limits.max_header_bytes + _READ_SIZE,
    }


def _at_least(low: float, parse: Callable[[str], int] = int) -> Callable[[str], int]:
    """An argparse type: a number >= low (a bad value is a usage error naming the flag, before anything loads)."""

    def check(text: str) -> int:
        value: int | None
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not value >= low:
            raise argparse.ArgumentTypeError(f"expected at least {low:g}, got {text!r}")
        return value

    return check


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def add_http_flags(parser: argparse.ArgumentParser, defaults: HttpLimits, parse_size: Callable[[str], int]) -> None:
    """The limits as command-line flags (the engine's; vLLM's h11 spellings kept as aliases)."""
    g = parser.add_argument_group("HTTP connection limits")
    g.add_argument(
        "--max-header-bytes",
        "--h11-max-incomplete-event-size",
        type=_at_least(1024, parse_size),
        default=defaults.max_header_bytes,
        help="request line + header fields, e.g. 64KiB; over it: 431 and the connection closed",
    )
    g.add_argument(
        "--max-header-fields",
        "--h11-max-header-count",
        type=_at_least(1),
        default=defaults.max_header_fields,
        help="header fields in one request; over it: 431",
    )
    g.add_argument(
        "--header-timeout",
        type=_positive_seconds,
        default=defaults.header_timeout_s,
        help="seconds for a request's whole head to arrive; then 408 and close",
    )
    g.add_argument(
        "--body-timeout",
        type=_positive_seconds,
        default=defaults.body_timeout_s,
        help="longest pause, in seconds, in a request body being read; then 408 and close",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=_positive_seconds,
        default=defaults.keep_alive_s,
        help="seconds an idle kept-alive connection stays open",
    )
    g.add_argument(
        "--max-body-bytes",
        type=_at_least(1, parse_size),
        default=defaults.max_body_bytes,
        help="request body size, e.g. 32MiB; over it: 413 and the connection closed",
    )
    g.add_argument(
        "--max-connections",
        type=_at_least(1),
        default=defaults.max_connections,
        help="open connections at once; one more is answered 503 and closed",
    )


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """The limits `add_http_flags`' flags give (checked as they were parsed)."""
    return HttpLimits(
        max_header_bytes=args.max_header_bytes,
        max_header_fields=args.max_header_fields,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keep_alive_s=args.timeout_keep_alive,
        max_connections=args.max_connections,
        max_body_bytes=args.max_body_bytes,
    )
