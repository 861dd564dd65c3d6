"""The engine's OpenAI-compatible HTTP API over an AsyncEngine: app (lifespan, middleware, error handlers), routes,
SSE streaming, errors, the client-disconnect watch, and the wire schemas (protocol: requests, responses: replies)."""

from tokenweir.engine.api.app import build_app

__all__ = ["build_app"]
