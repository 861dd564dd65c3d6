"""structlog JSON logs; the middleware binds each request's id so every line about it carries `request_id`."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def ensure_configured(level: str = "info") -> None:
    """JSON logs unless the embedding program configured structlog itself: structlog's own default renders
    tracebacks with their local variables, which would print request headers (API keys) into the log."""
    if not structlog.is_configured():
        configure(level)


def get_logger(name: str = "tokenweir.gateway"):
    return structlog.get_logger(name)


bind_request = structlog.contextvars.bind_contextvars
clear_request = structlog.contextvars.clear_contextvars
