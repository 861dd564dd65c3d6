"""The two ways one request ends in an error while the engine goes on: refused at the edge (`RequestError`, a 400)
or failed inside a step (`RequestFailed`, a 500). engine/api/errors.py maps them to HTTP."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine can never serve (too long, bad parameters): a 400 for the client, not a crash."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class RequestFailed(RuntimeError):
    """One request failed inside the engine (an error in its detokenizing, stop strings or start): it ends with an
    error while every other request goes on. A 500 for its client, and a request a router must not retry elsewhere:
    its own input may be what fails."""

    code = "request_failed"
