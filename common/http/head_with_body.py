"""A response's head held back to go out with its body's first write: httptools' door protocol (common.http.door) puts
each new request's transport behind one.
"""

from __future__ import annotations

import asyncio
from typing import Any


class HeadWithBody:
    """The transport as one response's cycle sees it: the response head (its first write) is held until the body's
    first write, and both go out in one `writelines`: one syscall and one TCP segment per small answer where
    uvicorn makes two. A head whose body does not follow at once (a stream waiting for its first chunk) is written
    at the end of the loop iteration that produced it, so nothing waits on it."""

    __slots__ = ("_transport", "_loop", "_held", "_first")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._held: bytes | None = None
        self._first = True

    def write(self, data: bytes) -> None:
        if self._first:
            self._first = False
            self._held = data
            self._loop.call_soon(self.flush)
            return
        held, self._held = self._held, None
        if held is None:
            self._transport.write(data)
        elif not self._transport.is_closing():
            self._transport.writelines((held, data))

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # the rest of the transport's interface, as it is
        return getattr(self._transport, name)
