"""An ASGI app under uvicorn in a daemon thread on a free port: the gateway (`serve_app`) or a fake upstream, for
tests that talk to them over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import uvicorn

from loadtests.fake_upstream import free_port

T = TypeVar("T")


class _Server(uvicorn.Server):
    """uvicorn's server, keeping the event loop it serves on (see `ServerThread.call`)."""

    loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)


class ServerThread:
    """Run any ASGI app under uvicorn in a daemon thread on a free port (tests and benchmarks)."""

    def __init__(self, app, port: int | None = None, host: str = "127.0.0.1", **uvicorn_kwargs) -> None:
        self.host, self.port = host, port or free_port()
        kwargs = {"log_level": "warning", "lifespan": "on", **uvicorn_kwargs}
        self.server = _Server(uvicorn.Config(app, host=host, port=self.port, **kwargs))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run `coro` on the app's event loop and wait for its result: what the app holds (a Redis asyncio client's
        connections) belongs to that loop, so a test on another thread cannot simply await it on its own."""
        assert self.server.loop is not None, "the server is not running"
        return asyncio.run_coroutine_threadsafe(coro, self.server.loop).result(timeout)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive(), "server thread died during startup"
            assert time.monotonic() < deadline, "server did not start in 20 s"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve_app(config, **create_app_kwargs) -> ServerThread:
    """The gateway for `config` under uvicorn in a thread: `with serve_app(cfg, store=s) as srv: srv.url`."""
    from tokenweir.gateway.app import create_app

    app = create_app(config, **create_app_kwargs)
    server = ServerThread(app, port=config.port or None)
    server.app = app
    return server


@contextlib.contextmanager
def two_replicas(tmp_path, config: Callable[[str], Any], state: Callable[[], Any] | None = None) -> Iterator[tuple]:
    """Two gateway replicas for `config("a")` and `config("b")`, each with its own connection to one SQLite store
    file and its own state backend (`state()`; in memory where None). Yields (the first replica's store, the two
    servers, the admin's headers)."""
    from tokenweir.gateway.state.memory import InMemoryState
    from tokenweir.gateway.store.store import Store

    stores = [Store.open(f"sqlite:///{tmp_path}/store.db") for _ in range(2)]
    try:
        with contextlib.ExitStack() as running:
            servers = [
                running.enter_context(serve_app(config(name), store=store, state_backend=(state or InMemoryState)()))
                for name, store in zip("ab", stores, strict=True)
            ]
            admin, _ = stores[0].create_key(None, "admin", is_admin=True)
            yield stores[0], servers, {"authorization": f"Bearer {admin}"}
    finally:
        for store in stores:
            store.close()
