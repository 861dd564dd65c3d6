"""cancel_on_disconnect on its own: the client's leaving cancels the waiting task and is told apart from a shutdown's
cancellation; once stopped, a leaving client cancels nothing."""

from __future__ import annotations

import asyncio

import pytest

from tokenweir.common.http.disconnect import cancel_on_disconnect


class Connection:
    """An ASGI `receive` whose next message is `http.disconnect` once `leave()` is called."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, object]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self.gone.set()


async def handler(connection: Connection, waiting: asyncio.Event) -> str:
    watch = cancel_on_disconnect(connection.receive)
    try:
        waiting.set()
        await asyncio.sleep(60)  # an upstream that takes its time
        return "answered"
    except asyncio.CancelledError:
        if not watch.client_left():
            raise
        await asyncio.sleep(0)  # uncancelled: the handler may still await (it settles the request)
        return "client left"
    finally:
        watch.stop()


async def test_a_leaving_client_cancels_the_wait_and_the_handler_goes_on_to_its_end():
    connection, waiting = Connection(), asyncio.Event()
    task = asyncio.create_task(handler(connection, waiting))
    await waiting.wait()
    connection.leave()
    assert await asyncio.wait_for(task, 5) == "client left"
    assert not task.cancelled()


async def test_a_shutdowns_cancellation_goes_through():
    connection, waiting = Connection(), asyncio.Event()
    task = asyncio.create_task(handler(connection, waiting))
    await waiting.wait()
    task.cancel()  # the server stopping, not the client
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_after_stop_a_leaving_client_cancels_nothing():
    connection = Connection()

    async def settles_after_stopping() -> str:
        watch = cancel_on_disconnect(connection.receive)
        watch.stop()
        connection.leave()
        await asyncio.sleep(0.05)  # the settle that follows a request's end
        return "settled"

    assert await asyncio.wait_for(settles_after_stopping(), 5) == "settled"
