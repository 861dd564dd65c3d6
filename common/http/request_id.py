"""The request-id rule both servers keep. A client's X-Request-Id is honoured when it is sane; else one is minted.
One rule, because the gateway sends its request id to the engine and later aborts the engine's request by it: an id
the gateway kept but the engine replaced could not be aborted, and its tokens would be generated for nobody."""

from __future__ import annotations

from tokenweir.common.ids import random_hex

MAX_REQUEST_ID = 128


def is_sane_request_id(value: str | None) -> bool:
    """1 to 128 printable ASCII characters without spaces: safe in a header, a log line and a JSON event."""
    if not value:
        return False
    return len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable() and " " not in value


def request_id_from(client_value: str | None, prefix: str = "req-") -> str:
    """The client's id when it is sane, else `prefix` + a fresh uuid."""
    return client_value if client_value and is_sane_request_id(client_value) else prefix + random_hex()
