"""Noticing that a client went away while its request runs."""

from __future__ import annotations

from starlette.types import Receive


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client is gone. Call it only once the request body has been read: from then on, the next
    ASGI message a connection can send is `http.disconnect`."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
