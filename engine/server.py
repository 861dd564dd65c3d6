"""The engine server's command line (`python -m engine.server`, `tokenweir engine`): parse the flags
(engine/flags.py), set up JSON logging (engine/log_format.py), load the model, serve the API of engine/api/ under
uvicorn."""

from __future__ import annotations

import os

# Only torch-free imports up here: `--help` and `--version` must answer without loading torch. The engine, the app
# and uvicorn are imported in main(), after the arguments are parsed.
from engine.flags import engine_config, parse_args
from engine.flags import parse_size as parse_size  # gateway/serve_engines.py reads its sizes through this module
from engine.log_format import configure_logging

KEEP_ALIVE_S = 75
GRACEFUL_SHUTDOWN_S = 10


def __getattr__(name: str):
    """`from engine.server import build_app` still works, without importing torch when the module is imported."""
    if name == "build_app":
        from engine.api import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def serving_threads() -> int:
    """Compute threads when serving: all cores but one. The event loop (HTTP, detokenizing, SSE) needs a core of its
    own; when it competes with the compute threads, every step waits at their barrier (batch-1 decode measured 42 tok/s
    with 1 thread and 22 with 2 on a 2-core machine)."""
    return max(1, (os.cpu_count() or 1) - 1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)

    import uvicorn

    from engine.api import build_app
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine

    try:
        config = engine_config(args)
        if config.num_threads is None:
            config.num_threads = serving_threads()
        print(f"tokenweir engine: loading {config.model or 'the default model'} ...", flush=True)
        engine = LLMEngine(config, progress=True)
    except (AssertionError, ValueError, FileNotFoundError, OSError) as exc:  # config and model problems
        raise SystemExit(f"tokenweir engine: cannot start: {exc}") from exc
    app = build_app(AsyncEngine(engine))
    print(f"tokenweir engine: serving {engine.model_name!r} on http://{args.host}:{args.port}/v1", flush=True)
    # Keep idle connections longer than clients' pools do (httpx expires them after 5 s), so a pooled client never
    # sends on a connection the server is closing at that very moment.
    # On SIGTERM, streams get GRACEFUL_SHUTDOWN_S to finish; then they are cancelled, which aborts them in the engine.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None,  # keep configure_logging's JSON handler; uvicorn's loggers propagate to it
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


if __name__ == "__main__":
    main()
