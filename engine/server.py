"""The engine server's command line (`python -m engine.server`, `tokenweir engine`): parse the flags, load the model,
serve the API of engine/api/ under uvicorn."""

from __future__ import annotations

import argparse
import logging
import re

from engine.api import build_app
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig

KEEP_ALIVE_S = 75
GRACEFUL_SHUTDOWN_S = 10

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '536870912', '512MiB', '2GiB', '1.5G' (binary units; 'MB' and 'MiB' both mean 2**20 here)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** " KMGT".index(unit or " "))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenweir engine", description="tokenweir's OpenAI-compatible engine server")
    p.add_argument("--model", default="", help="a .gguf file or a HF model directory (default: SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--served-model-name", default=None, help="the name clients put in `model`")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=parse_size, default=None, help="bytes for the KV cache, e.g. 512MiB")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="explicit KV pool size (overrides memory)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend=None if args.attention_backend == "auto" else args.attention_backend,
        num_threads=args.num_threads,
    )
    if args.kv_cache_memory is not None:
        config.kv_cache_memory = args.kv_cache_memory
    return config


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from engine.llm_engine import LLMEngine

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config(args)
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
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


if __name__ == "__main__":
    main()
