"""`tokenweir serve --workers N`: N gateway processes accepting on one listening socket, which the parent binds.

Parent (`GatewayWorkers`, in the process that ran `serve`): by now it has run the store's migrations, printed the
bootstrap keys and started the engines, all once. It writes the final config (the engines' pool included) to a
private file, starts the workers under gateway/process/supervisor.py (a worker that exits is logged and restarted with
doubling backoff), and on SIGTERM / SIGINT stops them all gracefully; the caller then stops the engines.

One inherited socket rather than SO_REUSEPORT: every worker accepts from the same queue, so a worker that dies or
drains strands no connection in a backlog of its own, and the port stays bound while one restarts.

Worker (`python -m gateway.process.workers`): the same app as a one-process `serve`, with its own event file
(`events.jsonl` -> `events.w<i>.jsonl`) and writer id, so lines never interleave and its start-up replays exactly
its own events after its own usage watermark, restart after restart. Limits and budgets are shared through Redis:
with the in-process state each worker would enforce every limit on its own, hence `require_shared_state`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import orjson

from tokenweir.gateway.config import GatewayConfig

STARTUP_FAILURE = 3  # uvicorn's exit status when the app's start-up fails


def require_shared_state(config: GatewayConfig) -> None:
    n = config.workers
    if not config.state_url:
        sys.exit(
            f"tokenweir: --workers {n} needs the shared state: set `state_url: redis://127.0.0.1:6379/0` in the "
            "config or TOKENWEIR_STATE_URL in the env (with the in-process state, each worker would enforce every "
            "rate limit and budget on its own)"
        )
    if ":memory:" in config.store_url:
        sys.exit(
            f"tokenweir: --workers {n} needs a store the workers share (a SQLite file or PostgreSQL), "
            f"not {config.store_url}"
        )


def worker_config(config: GatewayConfig, index: int) -> GatewayConfig:
    """Worker `index`'s own event file and writer id; its outbox file follows the event file."""
    ev = config.events
    path = Path(ev.path)
    own = path.with_name(f"{path.stem}.w{index}{path.suffix}")
    config.events = replace(ev, path=str(own), writer_id=ev.writer_id and f"{ev.writer_id}.w{index}")
    return config


class GatewayWorkers:
    def __init__(self, config: GatewayConfig, sock: socket.socket) -> None:
        from tokenweir.gateway.process.supervisor import Supervisor

        self.config, self.sock = config, sock
        # mkstemp: readable by this user only, as the config may hold upstream API keys (argv would show them).
        fd, self.config_path = tempfile.mkstemp(prefix="tokenweir-workers-", suffix=".json")
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(asdict(config)))
        self.supervisor = Supervisor(
            self.cmd,
            config.workers,
            config.port,  # unused: the workers share the socket
            on_exit=self.on_exit,
            on_start=self.on_start,
            spawn_kwargs={"pass_fds": (sock.fileno(),)},
        )
        logging.getLogger("tokenweir.supervisor").setLevel(logging.ERROR)  # it says "engine": ours says worker

    def cmd(self, index: int, _port: int) -> list[str]:
        fd = str(self.sock.fileno())
        return [
            sys.executable,
            "-m",
            "tokenweir.gateway.process.workers",
            "--index",
            str(index),
            "--fd",
            fd,
            "--config",
            self.config_path,
        ]

    async def run(self) -> None:
        """Until SIGTERM or SIGINT; then every worker drains and flushes (shutdown_grace_s each, then killed), and
        this process exits with 128 + the signal, as a one-process `serve` does."""
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        got: list[signal.Signals] = []

        def on_signal(sig: signal.Signals) -> None:
            got.append(sig)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await self.supervisor.start()
            await stop.wait()
        finally:
            # A SIGINT from a terminal reached the workers too; the SIGTERM after it changes nothing for uvicorn.
            await self.supervisor.stop(grace_s=self.config.shutdown_grace_s + 15)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            os.unlink(self.config_path)
        raise SystemExit(128 + got[0])

    def on_exit(self, child) -> None:
        from tokenweir.common.logging import get_logger

        get_logger("tokenweir.workers").warning(
            "gateway_worker_exited",
            worker=child.index,
            pid=getattr(child.proc, "pid", None),
            status=child.last_status,
            restarts=child.restarts,
            restart_in_s=child.backoff_s,
        )

    def on_start(self, child) -> None:
        if child.restarts:
            from tokenweir.common.logging import get_logger

            get_logger("tokenweir.workers").info(
                "gateway_worker_restarted", worker=child.index, pid=child.proc.pid, restarts=child.restarts
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.process.workers", description="one worker of `tokenweir serve --workers N`"
    )
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--fd", type=int, required=True, help="the listening socket, inherited")
    parser.add_argument("--config", required=True, help="the parent's final config, as JSON")
    args = parser.parse_args(argv)
    # Until uvicorn takes the signals over (nothing to flush yet), and when it re-raises the one it shut down
    # for: exit with the usual status, no traceback.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _frame: sys.exit(128 + s))
    import structlog

    from tokenweir.common.logging import configure
    from tokenweir.gateway.app import create_app
    from tokenweir.gateway.process.cli import gateway_server, load_config_or_exit

    config = worker_config(load_config_or_exit(args.config, env={}), args.index)
    configure(config.log_level)
    # Every log line says which worker wrote it (the request id alone does not).
    structlog.configure(processors=[_tag(args.index), *structlog.get_config()["processors"]])
    sock = socket.socket(fileno=args.fd)
    server = gateway_server(config, create_app(config))  # the app opens (and closes) its own store
    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        runner.run(_serve(server, sock, args.index, args.config))
    if not server.started:
        sys.exit(STARTUP_FAILURE)  # the lifespan failed; uvicorn logged why


def _tag(index: int):
    def tag(_logger, _method, event: dict) -> dict:
        event.setdefault("worker", index)
        return event

    return tag


async def _serve(server, sock: socket.socket, index: int, config_path: str) -> None:
    parent = os.getppid()
    watch = asyncio.create_task(_watch(server, index, parent))
    try:
        await server.serve(sockets=[sock])
    finally:
        watch.cancel()
        if os.getppid() != parent:  # orphaned: the parent can no longer remove the config file it wrote for us
            Path(config_path).unlink(missing_ok=True)


async def _watch(server, index: int, parent: int) -> None:
    """Say when serving; then, if the parent dies without stopping us, drain and exit rather than linger on the
    inherited port. (The kernel's SIGTERM on the parent's death, gateway/process/supervisor.py `die_with_parent`,
    usually comes first; this covers a platform without it.)"""
    while not server.started:
        await asyncio.sleep(0.05)
    print(f"tokenweir: gateway worker {index} (pid {os.getpid()}) ready", flush=True)
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    server.should_exit = True


if __name__ == "__main__":
    main()
