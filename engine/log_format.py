"""The engine's logs in the gateway's JSON format: structlog loggers as gateway.logging configures them, and stdlib
records (the engine's `tokenweir.*` loggers, uvicorn's) rendered by structlog into the same JSON on stderr."""

from __future__ import annotations

import logging
import sys


class _JsonHandler(logging.StreamHandler):
    """The root handler configure_logging installs (a class of its own, so a second call does not add another)."""


def configure_logging(level: str = "info") -> None:
    """One JSON format for the engine and the gateway: structlog loggers as gateway.logging configures them, and
    stdlib records (the engine's `tokenweir.*` loggers, uvicorn's) rendered by structlog into the same JSON."""
    import structlog

    from tokenweir.gateway.logging import ensure_configured

    ensure_configured(level)
    root = logging.getLogger()
    root.setLevel(level.upper())
    if not any(isinstance(h, _JsonHandler) for h in root.handlers):
        handler = _JsonHandler(sys.stderr)
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=[
                    structlog.stdlib.add_log_level,
                    structlog.stdlib.add_logger_name,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                ],
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(),
                ],
            )
        )
        root.addHandler(handler)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # through the root handler, not their own
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
