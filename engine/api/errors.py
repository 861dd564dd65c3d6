"""Every error the engine's API answers, in OpenAI's shape: `{"error": {message, type, param, code}}`.

`APIError` is the one error type the API layer raises, the gateway's own (common/http/errors.py: torch-free, so both
halves share it); `to_api_error` maps the engine's own exceptions onto it, so a JSON response (one exception handler per
type) and an error event inside an SSE stream say the same thing. A body that fails its schema is worded by the
gateway's `validation_error`, in the engine's codes ('invalid_request') and params ('messages[0].role'). Bad input is
always a 4xx naming the field, never a 500; a 500 means the engine itself failed.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenweir.common.http.errors import APIError
from tokenweir.common.http.validation import validation_error
from tokenweir.engine.core.async_engine import EngineDeadError
from tokenweir.engine.core.errors import RequestError, RequestFailed

__all__ = ["APIError", "add_error_handlers", "to_api_error"]

log = logging.getLogger("tokenweir.engine.server")


# The engine names every schema refusal but unparseable JSON `invalid_request` (its clients read that code).
_CODES = dict.fromkeys(
    ("missing_required_parameter", "unknown_parameter", "invalid_type", "invalid_value"), "invalid_request"
)


def to_api_error(exc: Exception) -> APIError:
    """The client-facing form of any exception a request can end with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):  # the engine refused the request: the client's to fix
        return APIError(400, str(exc), exc.code, exc.param)
    if isinstance(exc, RequestValidationError):
        return validation_error(exc.errors(), codes=_CODES, brackets=True)
    if isinstance(exc, StarletteHTTPException):  # no such route or method
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return APIError(exc.status_code, str(exc.detail), code)
    if isinstance(exc, RequestFailed):  # logged where it failed; the engine goes on
        return APIError(500, str(exc), exc.code)
    if isinstance(exc, EngineDeadError):
        if exc.in_flight:  # it was running when the loop died: perhaps the cause, so not to be retried elsewhere
            return APIError(500, f"engine error: {exc}", "engine_loop_died")
        return APIError(503, f"engine error: {exc}; it is restarting, retry", "engine_dead")
    log.error("engine error", exc_info=exc)  # anything else is a bug worth a trace
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
