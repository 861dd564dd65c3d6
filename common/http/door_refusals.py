"""The answers the door gives (`Refusal`): an OpenAI-shaped JSON error written straight to the transport, with
`connection: close`, for a head or body over `HttpLimits` (the door protocols raise them from uvicorn's parser
callbacks)."""

from __future__ import annotations

import http
import json

from tokenweir.common.http.door_limits import HttpLimits


class Refusal(Exception):
    """An answer at the door: raised inside the parser's callbacks to stop parsing, then written out."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: tuple[tuple[bytes, bytes], ...] = (),
        *,
        in_flight: bool = False,  # about the request the app is handling (else about a head it never saw)
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers, self.in_flight = status, code, message, headers, in_flight

    def response(self, default_headers: list[tuple[bytes, bytes]]) -> bytes:
        error_type = "service_unavailable" if self.status == 503 else "invalid_request_error"
        body = json.dumps(
            {"error": {"message": self.message, "type": error_type, "param": None, "code": self.code}}
        ).encode()
        phrase = http.HTTPStatus(self.status).phrase
        lines = [f"HTTP/1.1 {self.status} {phrase}\r\n".encode()]
        headers = [
            *default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *self.headers,
        ]
        lines += [name + b": " + value + b"\r\n" for name, value in headers]
        return b"".join([*lines, b"\r\n", body])


def head_too_large(limits: HttpLimits) -> Refusal:
    return Refusal(
        431,
        "header_too_large",
        f"The request line and headers exceed this server's limit of {limits.max_header_bytes} bytes; "
        "send fewer or shorter headers.",
    )


def too_many_fields(limits: HttpLimits, in_flight: bool = False) -> Refusal:
    return Refusal(
        431,
        "too_many_headers",
        f"The request has more than this server's limit of {limits.max_header_fields} header fields; send fewer.",
        in_flight=in_flight,
    )


def body_too_large(limits: HttpLimits, in_flight: bool = True) -> Refusal:
    return Refusal(
        413,
        "body_too_large",
        f"The request body is larger than this server's limit of {limits.max_body_bytes} bytes.",
        in_flight=in_flight,
    )


def content_length_over(headers: list[tuple[bytes, bytes]], limit: int | None) -> bool:
    return limit is not None and any(
        name == b"content-length" and value.strip().isdigit() and int(value) > limit for name, value in headers
    )
