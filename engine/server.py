"""The engine server's command line (`python -m engine.server`, `tokenweir engine`): parse the flags
(engine/flags.py), set up JSON logging (common/logging.py), load the model, serve the API of engine/api/ under
uvicorn."""

from __future__ import annotations

import os
import signal
from functools import partial

from tokenweir.common.logging import configure

# Only torch-free imports up here: `--help` and `--version` must answer without loading torch. The engine, the app
# and uvicorn are imported in main(), after the arguments are parsed.
from tokenweir.engine.flags import KEEP_ALIVE_S as KEEP_ALIVE_S  # tests serve the app with the engine's keep-alive
from tokenweir.engine.flags import api_key, engine_config, parse_args, tracing_exporter

GRACEFUL_SHUTDOWN_S = 10


def serving_threads() -> int:
    """Compute threads when serving: every core. The event loop's work per step (HTTP, detokenizing, SSE) is small
    next to a step; what once made a core for it pay (batch-1 decode 42 tok/s with 1 thread, 22 with 2, on 2 cores)
    was the model loaded on one thread and stepped on another (see EngineThread). With both on the engine's thread,
    over HTTP on 2 cores: ~64 tok/s with 2 threads, ~50 with 1."""
    return max(1, os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure(args.log_level)

    import uvicorn

    from tokenweir.common.http.door_limits import http_limits_from_args, uvicorn_options
    from tokenweir.common.tracing import make_provider
    from tokenweir.engine.api import build_app
    from tokenweir.engine.api.tracing import SERVICE_NAME
    from tokenweir.engine.core.async_engine import AsyncEngine, EngineThread
    from tokenweir.engine.core.llm_engine import LLMEngine

    try:
        tracer_provider = None
        if (exporter := tracing_exporter(args)) is not None:  # first: a missing package stops it before the load
            tracer_provider = make_provider(SERVICE_NAME, exporter, args.otlp_traces_endpoint)
        config = engine_config(args)
        if config.num_threads is None:
            config.num_threads = serving_threads()
        print(f"tokenweir engine: loading {config.model or 'the default model'} ...", flush=True)
        thread = EngineThread()  # loads the model, then runs the step loop: one thread does all the compute
        engine = thread.call(partial(LLMEngine, config, progress=True))
    except (AssertionError, ValueError, FileNotFoundError, OSError) as exc:  # config and model problems
        raise SystemExit(f"tokenweir engine: cannot start: {exc}") from exc
    # A dead step loop serves nothing ever again: stop the server (its graceful shutdown lets the failed requests'
    # errors go out), then exit non-zero below, so a supervisor restarts the process instead of routing to a husk.
    async_engine = AsyncEngine(engine, thread=thread, on_dead=lambda _cause: os.kill(os.getpid(), signal.SIGTERM))
    app = build_app(
        async_engine, api_key=api_key(args), tracer_provider=tracer_provider, tool_call_parser=args.tool_call_parser
    )
    print(f"tokenweir engine: serving {engine.model_name!r} on http://{args.host}:{args.port}/v1", flush=True)
    # Connections are bounded at the door (head size and deadline, body pauses, keep-alive of KEEP_ALIVE_S, open
    # connections): --max-header-bytes and the other flags of common/http/door_limits.py.
    # On SIGTERM, streams get GRACEFUL_SHUTDOWN_S to finish; then they are cancelled, which aborts them in the engine.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None,  # keep the JSON root handler of common/logging.py; uvicorn's loggers propagate to it
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **uvicorn_options(http_limits_from_args(args)),
    )
    if async_engine.errored is not None:
        raise SystemExit(f"tokenweir engine: the step loop died ({async_engine.errored!r}); exiting to be restarted")


if __name__ == "__main__":
    main()
