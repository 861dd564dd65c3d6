"""Every error the engine's API answers, in OpenAI's shape: `{"error": {message, type, param, code}}`.

`APIError` is the one error type the API layer raises, the gateway's own (gateway/errors.py: torch-free, so both halves
share it); `to_api_error` maps the engine's own exceptions onto it, so a JSON response (one exception handler per type)
and an error event inside an SSE stream say the same thing.
Bad input is always a 4xx naming the field, never a 500; a 500 means the engine itself failed.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import EngineDeadError
from engine.llm_engine import RequestError
from gateway.errors import APIError

__all__ = ["APIError", "add_error_handlers", "describe_validation_error", "to_api_error"]

log = logging.getLogger("tokenweir.engine.server")


def to_api_error(exc: Exception) -> APIError:
    """The client-facing form of any exception a request can end with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):  # the engine refused the request: the client's to fix
        return APIError(400, str(exc), exc.code, exc.param)
    if isinstance(exc, RequestValidationError):
        return APIError(400, *describe_validation_error(exc.errors()))
    if isinstance(exc, StarletteHTTPException):  # no such route or method
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return APIError(exc.status_code, str(exc.detail), code)
    if not isinstance(exc, EngineDeadError):  # expected once the loop died; anything else is a bug worth a trace
        log.error("engine error", exc_info=exc)
    return APIError(500, f"engine error: {exc}", "engine_error")


def add_error_handlers(app: FastAPI) -> None:
    """One handler, registered per exception type. The types named here are answered inside the middleware stack
    (so the response still gets its X-Request-Id); a bare Exception is answered by Starlette's outermost
    ServerErrorMiddleware, which also logs it."""

    async def render(_request: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response()

    for exc_type in (APIError, RequestError, EngineDeadError, RequestValidationError, StarletteHTTPException):
        app.add_exception_handler(exc_type, render)
    app.add_exception_handler(Exception, render)


_UNION_TAG = re.compile(r"[\[\]()]|^(str|int|float|bool|list|dict|none|function-.*)$")


def describe_validation_error(errors) -> tuple[str, str, str | None]:
    """(message, code, param) for pydantic's errors: the most specific error first, its field path as param."""
    errors = list(errors)
    if not errors:
        return "invalid request", "invalid_request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", "invalid_json", None
    # A union reports one error per branch; a value_error (our own check) is what the client needs to read.
    err = next((e for e in errors if e.get("type") == "value_error"), first)
    loc = [part for part in err.get("loc", ()) if part != "body"]
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _UNION_TAG.search(str(part)):
            break
        else:
            path += ("." if path else "") + str(part)
    message = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "missing":
        message = f"{path} is required" if path else "a JSON request body is required"
    elif path:
        message = f"{path}: {message}"
    return message, "invalid_request", path or None
