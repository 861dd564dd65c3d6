"""A small TCP proxy for fault injection: put it between the gateway and Redis (or an upstream) and cut the link.

    with TCPProxy(6379) as proxy:          # listens on 127.0.0.1:<free port>, forwards to 127.0.0.1:6379
        url = f"redis://127.0.0.1:{proxy.port}/0"
        proxy.cut()                         # close every live connection; new ones are refused
        proxy.restore()                     # accept and forward again

`cut(mode=..., rst=True)`: live connections are reset (RST, as a network drop or a crashed peer with unread data
looks; `rst=False`: closed with a FIN, as a Redis that exits cleanly closes them). Then, by `mode`:
  - "refuse" (default): live connections are closed at once, new connects get ECONNREFUSED (the listener is
    closed; `restore()` listens again on the same port). Looks like a Redis that died.
  - "reset": live connections are closed; new connects are accepted and closed at once.
  - "blackhole": live connections are closed; new connects are accepted and then nothing is ever answered
    (a partition: the client hangs until its own timeout). `restore()` closes the held sockets.

`latency_s` (settable at any time): each chunk from the target waits this long before it is passed on (a slow
Redis: the command runs at once, its answer arrives late).

Runs an asyncio loop in a daemon thread; every method is thread-safe and bounded in time. Counters:
`accepted` (connections ever accepted), `live` (open now), `refused_while_cut` (accepted and dropped while cut).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

_MODES = ("refuse", "reset", "blackhole")


class TCPProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", port: int = 0) -> None:
        self.target_host, self.target_port = target_host, target_port
        self._want_port = port
        self.port = 0
        self.mode: str | None = None  # None while forwarding; else how the link is cut
        self.accepted = 0
        self.refused_while_cut = 0
        self.latency_s = 0.0  # delay of every chunk from the target to the client
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter | None]] = set()
        self._held: set[asyncio.StreamWriter] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # --- life cycle ---------------------------------------------------------------------------------------
    def start(self) -> TCPProxy:
        self._thread = threading.Thread(target=self._run, name=f"tcp-proxy->{self.target_port}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("tcp proxy did not start in 10 s")
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._listen(self._want_port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _listen(self, port: int) -> None:
        # port 0 the first time (a free one); the same port again after a "refuse" cut
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(1024)
        sock.setblocking(False)
        self._server = await asyncio.start_server(self._handle, sock=sock)
        self.port = sock.getsockname()[1]

    def stop(self) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(self._close_all(close_listener=True))
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> TCPProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def live(self) -> int:
        return len(self._conns)

    # --- faults -------------------------------------------------------------------------------------------
    def cut(self, mode: str = "refuse", rst: bool = True) -> None:
        """Close every live connection (RST, or FIN with rst=False) and refuse (or drop, or blackhole) new ones
        until `restore()`."""
        assert mode in _MODES, mode
        self._call(self._cut(mode, rst))

    def restore(self) -> None:
        """Forward again (listening on the same port)."""
        self._call(self._restore())

    def _call(self, coro, timeout: float = 10.0):
        assert self._loop is not None, "proxy not started"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _cut(self, mode: str, rst: bool = True) -> None:
        self.mode = mode
        await self._close_all(close_listener=mode == "refuse", rst=rst)

    async def _restore(self) -> None:
        was = self.mode
        self.mode = None
        for w in list(self._held):
            _abort(w)
        self._held.clear()
        if was == "refuse" or self._server is None:
            await self._listen(self.port)

    async def _close_all(self, close_listener: bool, rst: bool = True) -> None:
        if close_listener and self._server is not None:
            self._server.close()
            self._server = None
        close = _abort if rst else _close
        for a, b in list(self._conns):
            close(a)
            if b is not None:
                close(b)
        self._conns.clear()

    # --- forwarding ---------------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.mode is not None:
            self.refused_while_cut += 1
            if self.mode == "blackhole":
                self._held.add(writer)
                return  # never read, never answer
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port), 5
            )
        except (OSError, TimeoutError):
            _abort(writer)
            return
        pair = (writer, up_writer)
        self._conns.add(pair)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer, slow=True))
        finally:
            self._conns.discard(pair)
            _abort(writer)
            _abort(up_writer)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slow: bool = False) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if slow and self.latency_s > 0:
                    await asyncio.sleep(self.latency_s)
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            # one side ended: end the other so the peer sees EOF, as a direct connection would
            with contextlib.suppress(Exception):
                if writer.can_write_eof():
                    writer.write_eof()
                else:
                    writer.close()


def _close(writer: asyncio.StreamWriter) -> None:
    """A graceful close (FIN), as a peer process that exits cleanly closes its sockets."""
    with contextlib.suppress(Exception):
        writer.close()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close at once with a RST, not a graceful FIN: the peer sees the connection die, as when a server dies."""
    with contextlib.suppress(Exception):
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()
