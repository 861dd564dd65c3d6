"""Noticing that a client went away while its request runs: the gateway's admission and SSE relay (cancel_on_disconnect)
and the engine's API share this one watch. Torch-free, so both halves can import it."""

from __future__ import annotations

import asyncio

from starlette.types import Receive


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client is gone. Call it only once the request body has been read: from then on, the next
    ASGI message a connection can send is `http.disconnect`."""
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectWatch:
    """Cancels the task that started it when the client goes, until `stop()`. See cancel_on_disconnect."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None, "a watch cancels the task that runs the request"
        self._task, self._watching = task, True
        self._watch = asyncio.ensure_future(wait_disconnect(receive))
        self._watch.add_done_callback(self._gone)

    def _gone(self, watch: asyncio.Future[None]) -> None:
        if self._watching and not watch.cancelled():
            self._task.cancel()

    def client_left(self) -> bool:
        """In an `except asyncio.CancelledError`: True if the client's leaving cancelled the task, which is then
        uncancelled (the caller ends the request and returns); False if the cancellation is someone else's (the
        server shutting down), which the caller must let through."""
        if self._watch.done() and not self._watch.cancelled():
            self._task.uncancel()
            return True
        return False

    def stop(self) -> None:
        """Stop watching (idempotent): what follows, such as settling the request, is not cancelled by a leaving
        client."""
        self._watching = False
        self._watch.cancel()


def cancel_on_disconnect(receive: Receive) -> DisconnectWatch:
    """Watch for the client leaving while this task waits on something (the dispatch queue, an upstream, a stream's
    pump): when it goes, the task is cancelled, and `client_left()` tells that cancellation from a shutdown's. Start it
    once the request body has been read (wait_disconnect)."""
    return DisconnectWatch(receive)
