"""One JSON log format for every process (gateway, workers, engines) and every logger: structlog's loggers, the
stdlib's (`tokenweir.*`, uvicorn's) rendered by structlog into the same JSON object a line on stderr. The request
middleware binds each request's id, so every line about a request carries `request_id`."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog
from structlog.typing import FilteringBoundLogger

_TIMESTAMP = structlog.processors.TimeStamper(fmt="iso", utc=True)


class _JsonHandler(logging.StreamHandler[TextIO]):
    """The root handler `configure` installs (a class of its own, so a second call does not add another)."""


def configure(level: str = "info") -> None:
    """JSON logs for a whole process: structlog, the stdlib root logger, and uvicorn's loggers through the root
    (serve uvicorn with log_config=None, or its own dictConfig puts plain-text handlers back)."""
    _configure_structlog(level)
    root = logging.getLogger()
    root.setLevel(level.upper())
    if not any(isinstance(h, _JsonHandler) for h in root.handlers):
        root.addHandler(_json_handler())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


def ensure_configured(level: str = "info") -> None:
    """JSON logs unless the embedding program configured them itself (a test harness, an app inside another): never
    structlog's own default, which renders tracebacks with their local variables and so would print request headers
    (API keys); never the stdlib's last-resort handler, which prints plain text."""
    if not structlog.is_configured():
        _configure_structlog(level)
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(_json_handler())


def _configure_structlog(level: str) -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _TIMESTAMP,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def _json_handler() -> logging.Handler:
    handler = _JsonHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name, _TIMESTAMP],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    return handler


def get_logger(name: str = "tokenweir.gateway") -> FilteringBoundLogger:
    # structlog.get_logger is typed Any; what it returns binds to the wrapper `_configure_structlog` installs
    logger: FilteringBoundLogger = structlog.get_logger(name)
    return logger


bind_request = structlog.contextvars.bind_contextvars
clear_request = structlog.contextvars.clear_contextvars
