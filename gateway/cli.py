"""`tokenweir`: `serve` (gateway + one bundled engine child process) and `engine` (the engine server alone).

Arguments are parsed before anything heavy is imported (uvicorn, the app; torch only for `engine`)."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from gateway.config import GatewayConfig, PoolConfig, UpstreamConfig, load_config


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
        from engine.server import main as engine_main  # lazy: torch and the model load only for this command

        return engine_main(argv[1:])
    parser = argparse.ArgumentParser(prog="tokenweir", description="multi-tenant OpenAI-compatible gateway")
    parser.add_argument("--version", action="version", version=f"tokenweir {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    # Flags default to None so that the config file and env decide; the help shows the built-in default.
    d = GatewayConfig()
    serve = sub.add_parser(
        "serve",
        help="run the gateway with one bundled engine",
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
    config = load_config(args.config)
    for name, value in (("host", args.host), ("port", args.port), ("store_url", args.store)):
        if value is not None:
            setattr(config, name, value)
    if args.engine_port is not None:
        config.engine.port = args.engine_port
    if args.model is not None:
        config.engine.model_path = args.model
    if args.no_engine:
        config.engine.enabled = False
    serve_forever(config)


def serve_forever(config: GatewayConfig) -> None:
    import uvicorn

    from gateway.app import create_app
    from gateway.bootstrap import ensure_bootstrap
    from gateway.logging import configure
    from gateway.store import Store

    configure(config.log_level)
    engine = None
    # SIGTERM during startup (engine still loading) must still take the child down with us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if config.engine.enabled:
            engine = start_engine(config)
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
        if config.port == 0:  # bind here, so the line below names the port the OS picked
            sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((config.host, 0))
            config.port = sock.getsockname()[1]
        base = f"http://{config.host}:{config.port}/v1"
        print(f"tokenweir: gateway on {base}  models: {', '.join(p.model for p in config.pools)}", flush=True)
        app = create_app(config, store=store)
        try:
            # uvicorn installs its own SIGTERM handler: a graceful shutdown that runs the lifespan exit,
            # which flushes usage and events.
            server = uvicorn.Server(
                uvicorn.Config(
                    app,
                    host=config.host,
                    port=config.port,
                    log_level="warning",
                    access_log=config.access_log,
                    timeout_graceful_shutdown=config.shutdown_grace_s,
                )
            )
            server.run(sockets=[sock] if sock is not None else None)
        finally:
            store.close()
    finally:
        if engine is not None:
            stop_engine(engine)


def start_engine(config: GatewayConfig) -> subprocess.Popen:
    import httpx

    from engine.config import default_model_path

    ec = config.engine
    try:
        model_path = ec.model_path or default_model_path()
    except FileNotFoundError as e:
        sys.exit(f"tokenweir: {e} (or pass --model, or --no-engine with pools of your own)")
    cmd = [sys.executable, "-m", "engine.server", "--port", str(ec.port), "--served-model-name", ec.model_name]
    cmd += ["--log-level", "warning"]  # its access log would print every /load poll
    if model_path:
        cmd += ["--model", model_path]
    cmd += ec.extra_args
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{ec.port}"
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            sys.exit(f"tokenweir: the engine exited with status {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        waited = time.monotonic() - t0
        if waited > ec.startup_timeout_s:
            stop_engine(proc)
            sys.exit(f"tokenweir: the engine did not become healthy in {ec.startup_timeout_s:g}s")
        print(f"\rtokenweir: waiting for the engine on {url} ... {waited:4.0f}s", end="", flush=True)
        time.sleep(0.5)
    print(f"\rtokenweir: engine ready on {url} ({time.monotonic() - t0:.1f}s)          ", flush=True)
    if config.pool(ec.model_name) is None:
        tokenizer = model_path if model_path and model_path.endswith(".gguf") else None
        # The engine knows its context window (model and KV pool): the gateway enforces it before dispatch.
        models = httpx.get(url + "/v1/models", timeout=5.0).json().get("data") or [{}]
        pool = PoolConfig(model=ec.model_name, upstreams=[UpstreamConfig(url)], tokenizer=tokenizer)
        pool.max_context = models[0].get("max_model_len")
        config.pools.insert(0, pool)
    return proc


def stop_engine(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
