"""Noticing that a client went away while its request runs: the gateway's admission and SSE relay and the engine's
API (engine/api/disconnect.py) share this one watch. Torch-free, so both halves can import it."""

from __future__ import annotations

from starlette.types import Receive


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client is gone. Call it only once the request body has been read: from then on, the next
    ASGI message a connection can send is `http.disconnect`."""
    while (await receive())["type"] != "http.disconnect":
        pass
