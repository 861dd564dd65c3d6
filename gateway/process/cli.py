"""`tokenweir`: `serve` (gateway + bundled engine child processes) and `engine` (the engine server alone).

`serve` starts one engine child (`--engines 1`, the default), or N supervised ones as one pool (`--engines N`,
`engine.replicas`; gateway/process/engines.py), then runs the gateway in this process, or in N worker processes on
one port (`--workers N`, `workers`; gateway/process/workers.py). Arguments are parsed before anything heavy is
imported (uvicorn, the app); `engine` replaces this process with `python -m tokenweir.engine.server`."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

from tokenweir.gateway.config import GatewayConfig, load_config


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("tokenweir")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "engine":
        # By command, not by import: the gateway never imports the engine (nor torch). exec keeps the pid, so a
        # supervisor's signals reach the engine itself.
        os.execv(sys.executable, [sys.executable, "-m", "tokenweir.engine.server", *argv[1:]])
    parser = argparse.ArgumentParser(prog="tokenweir", description="multi-tenant OpenAI-compatible gateway")
    parser.add_argument("--version", action="version", version=f"tokenweir {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    # Flags default to None so that the config file and env decide; the help shows the built-in default.
    d = GatewayConfig()
    serve = sub.add_parser(
        "serve",
        help="run the gateway with the bundled engine (one, or --engines N)",
        description="Run the gateway (and, unless --no-engine, the bundled engine as a child process). "
        "Precedence: these flags, then env TOKENWEIR_*, then the config file, then the defaults shown.",
    )
    serve.add_argument(
        "--config", help="YAML or TOML file (see config.example.yaml); env TOKENWEIR_* overrides (default: none)"
    )
    serve.add_argument("--host", default=None, help=f"gateway bind address (default: {d.host})")
    serve.add_argument("--port", type=int, default=None, help=f"gateway port; 0 picks a free one (default: {d.port})")
    serve.add_argument("--engine-port", type=int, default=None, help=f"bundled engine port (default: {d.engine.port})")
    serve.add_argument(
        "--engines",
        type=int,
        default=None,
        metavar="N",
        help="bundled engine children, on consecutive free ports from --engine-port, as one pool (prefix "
        "routing); with N > 1 each is restarted with backoff when it exits and gets 1/N of the CPU threads and "
        f"of engine.kv_cache_memory (default: {d.engine.replicas})",
    )
    serve.add_argument(
        "--prefill-engines",
        type=int,
        default=None,
        metavar="M",
        help="disaggregated prefill: the first M of the --engines N compute prompts and hand their KV to the "
        f"others, which decode; every chat and completion takes both hops (default: {d.engine.prefill_replicas})",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="gateway worker processes on the one port, each restarted with backoff when it exits; N > 1 needs "
        f"the shared state (state_url: redis://...) and a database file or server as the store (default: {d.workers})",
    )
    serve.add_argument(
        "--no-engine",
        action="store_true",
        help="do not start an engine; serve the config's pools (default: start it unless engine.enabled is false)",
    )
    serve.add_argument(
        "--model",
        default=None,
        help="GGUF (or HF dir) for the bundled engine (default: the bundled SmolLM2-135M-Instruct)",
    )
    serve.add_argument("--store", default=None, help=f"store URL (default: {d.store_url})")
    sub.add_parser("engine", help="run the engine server alone (see `tokenweir engine --help`)")
    args = parser.parse_args(argv)
    config = load_config_or_exit(args.config)
    for name, value in (("host", args.host), ("port", args.port), ("store_url", args.store)):
        if value is not None:
            setattr(config, name, value)
    if args.engine_port is not None:
        config.engine.port = args.engine_port
    if args.engines is not None:
        if args.engines < 1:
            parser.error("--engines: at least 1")
        config.engine.replicas = args.engines
    if args.prefill_engines is not None:
        if not 0 <= args.prefill_engines < config.engine.replicas:
            parser.error("--prefill-engines: from 0 to --engines - 1 (at least one engine decodes)")
        config.engine.prefill_replicas = args.prefill_engines
    if args.workers is not None:
        if args.workers < 1:
            parser.error("--workers: at least 1")
        config.workers = args.workers
    if args.model is not None:
        config.engine.model_path = args.model
    if args.no_engine:
        config.engine.enabled = False
    from tokenweir.gateway.process.bootstrap import ADMIN_KEY_ENV, admin_key_error

    if (error := admin_key_error(os.environ.get(ADMIN_KEY_ENV))) is not None:  # before an engine loads for nothing
        sys.exit(f"tokenweir: configuration error: {error}")
    serve_forever(config)


def load_config_or_exit(path: str | None, env: dict[str, str] | None = None) -> GatewayConfig:
    """The config, or exit with one line naming the setting at fault (an operator's mistake is no traceback)."""
    import yaml

    try:
        return load_config(path, env)
    except (ValueError, TypeError, OSError, yaml.YAMLError) as e:
        sys.exit(f"tokenweir: configuration error: {' '.join(str(e).split())}")


def serve_forever(config: GatewayConfig) -> None:
    from tokenweir.common.logging import configure
    from tokenweir.gateway.process.engines import EngineReplicas, start_engine, stop_engine

    configure(config.log_level)
    if config.workers > 1:
        from tokenweir.gateway.process.workers import require_shared_state

        require_shared_state(config)  # before any engine is started for nothing
    # SIGTERM during startup (engine still loading) must still take the children down with us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if config.engine.enabled and config.engine.replicas > 1:
        replicas = EngineReplicas(config)
        try:
            asyncio.run(serve_with_replicas(config, replicas))
        finally:
            replicas.kill_leftovers()
        return
    engine = None
    try:
        if config.engine.enabled:
            engine = start_engine(config)
        if config.workers > 1:
            asyncio.run(serve_workers(config))
            return
        from tokenweir.gateway.app import create_app

        store, sock = open_gateway(config)
        app = create_app(config, store=store)
        try:
            gateway_server(config, app).run(sockets=[sock] if sock is not None else None)
        finally:
            store.close()
    finally:
        if engine is not None:
            stop_engine(engine)


async def serve_with_replicas(config: GatewayConfig, replicas) -> None:
    """The engine replicas run in this event loop, beside the gateway (its instances marked down on an engine's
    exit) or beside the gateway workers."""
    from tokenweir.gateway.app import create_app

    try:
        await replicas.start()
        if config.workers > 1:
            return await serve_workers(config)
        store, sock = open_gateway(config)
        try:
            app = create_app(
                config, store=store, on_started=lambda services: replicas.attach(services.metrics, services.upstreams)
            )
            await gateway_server(config, app).serve(sockets=[sock] if sock is not None else None)
        finally:
            store.close()
    finally:
        await replicas.stop()


async def serve_workers(config: GatewayConfig) -> None:
    """Store migrations and bootstrap keys here, once; then the workers on the socket bound here, until SIGTERM or
    SIGINT (then they drain, flush, and exit, before the caller stops the engines)."""
    from tokenweir.gateway.process.workers import GatewayWorkers

    store, sock = open_gateway(config, bind=True)
    store.close()  # each worker opens its own
    try:
        await GatewayWorkers(config, sock).run()
    finally:
        sock.close()


def open_gateway(config: GatewayConfig, bind: bool = False):
    """The store (bootstrap keys printed once) and, for port 0 or `bind`, the socket bound (and, with `bind`,
    listening) here; prints the gateway line."""
    from tokenweir.gateway.process.bootstrap import ensure_bootstrap
    from tokenweir.gateway.store.store import Store

    if not config.pools:
        sys.exit("tokenweir: no upstream pools: configure `pools:` or drop --no-engine")
    if config.store_url.startswith("sqlite:///") and ":memory:" not in config.store_url:
        Path(config.store_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    store = Store.open(config.store_url)
    admin_secret, demo_secret = ensure_bootstrap(store)  # + $TOKENWEIR_ADMIN_KEY, stored hashed if set
    if admin_secret:
        print(f"tokenweir: bootstrap ADMIN key (shown once, keep it safe): {admin_secret}", flush=True)
    if demo_secret:
        print(f"tokenweir: demo team key (shown once): {demo_secret}", flush=True)
    sock = None
    if config.port == 0 or bind:  # bind here: the line below names the port the OS picked; workers share it
        sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((config.host, config.port))
        except OSError as e:
            sys.exit(f"tokenweir: cannot listen on {config.host}:{config.port}: {e}")
        if bind:  # connections queue from now on, while the workers start
            sock.listen(2048)
        config.port = sock.getsockname()[1]
    base = f"http://{config.host}:{config.port}/v1"
    workers = f"  ({config.workers} workers)" if config.workers > 1 else ""
    print(f"tokenweir: gateway on {base}  models: {', '.join(p.model for p in config.pools)}{workers}", flush=True)
    return store, sock


def gateway_server(config: GatewayConfig, app):
    import uvicorn

    from tokenweir.common.http.door_limits import uvicorn_options

    # uvicorn installs its own SIGTERM handler: a graceful shutdown that runs the lifespan exit, which flushes usage
    # and events. The workers of `serve --workers N` are built here too, so they get the same `http:` limits.
    return uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            log_config=None,  # its loggers propagate to the JSON root handler of common/logging.py
            access_log=config.access_log,
            # annotated int, but only ever a timeout for asyncio.wait_for: seconds as a float work
            timeout_graceful_shutdown=config.shutdown_grace_s,  # type: ignore[arg-type]
            **uvicorn_options(config.http),
        )
    )


if __name__ == "__main__":
    main()
