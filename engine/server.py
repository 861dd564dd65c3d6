"""The engine server's command line (`python -m engine.server`, `tokenweir engine`): parse the flags, load the model,
serve the API of engine/api/ under uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

# Only torch-free imports up here: `--help` and `--version` must answer without loading torch. The engine, the app
# and uvicorn are imported in main(), after the arguments are parsed.
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


DTYPES = ("auto", "float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's spellings


def parse_dtype(text: str) -> str:
    dtype = _DTYPE_ALIASES.get(text, text)
    if dtype not in DTYPES:
        raise argparse.ArgumentTypeError(f"unsupported dtype {text!r}: choose from {', '.join(DTYPES)}")
    return dtype


def parse_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"not a fraction in (0, 1]: {text!r}")
    return value


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("tokenweir")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show (None, ""): their help says what happens."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == "":
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The engine's flags; vLLM's names where vLLM has the flag (older tokenweir spellings stay as aliases)."""
    d = EngineConfig()
    p = argparse.ArgumentParser(
        prog="tokenweir engine",
        description="tokenweir's OpenAI-compatible engine server",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"tokenweir engine {version()}", help="print the version")
    p.add_argument(
        "--model", default="", help="a .gguf file or a HF model directory (default: the bundled SmolLM2-135M)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8100, help="port to listen on")
    p.add_argument(
        "--served-model-name", default=None, help="the name clients put in `model` (default: the model's own name)"
    )
    p.add_argument(
        "--dtype",
        type=parse_dtype,
        default=d.dtype,
        help="activations and dense weights; auto = bfloat16 on CUDA and on CPUs with native bf16 (probed at "
        "start), float32 elsewhere (vLLM's 'float' and 'half' are accepted)",
    )
    p.add_argument(
        "--quantization",
        "-q",
        choices=("none", "int8", "auto"),
        default=d.quantization,
        help="weight format; int8 = per-channel int8 weights (CPU); auto = int8 where a start-up probe shows it "
        "faster than dense weights on this CPU",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the sampler's generator for unseeded requests")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block (a power of two)")
    p.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=d.kv_cache_memory,
        help="bytes for the KV cache on CPU, e.g. 512MiB (on CUDA --gpu-memory-utilization sizes it)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=parse_fraction,
        default=d.gpu_memory_utilization,
        help="on CUDA: fraction of the GPU's memory the engine may fill (the KV cache takes what is left of it)",
    )
    p.add_argument(
        "--num-kv-blocks",
        "--num-gpu-blocks-override",
        dest="num_kv_blocks",
        type=int,
        default=None,
        help="explicit KV pool size in blocks (overrides the memory-based sizing)",
    )
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one batch")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="most tokens computed per step"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (prompt + output) (default: the model's, capped by the KV pool)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse the KV blocks of shared prompt prefixes",
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=argparse.SUPPRESS,  # the default is --enable-prefix-caching's
        help="same as --no-enable-prefix-caching",
    )
    p.add_argument(
        "--attention-backend", choices=["auto", "torch", "triton"], default="auto", help="auto: triton on CUDA"
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch CPU threads (default: all cores but one, left to the HTTP event loop)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="JSON logs on stderr at this level and above (uvicorn's access log included at info)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=None if args.attention_backend == "auto" else args.attention_backend,
        num_threads=args.num_threads,
        seed=args.seed,
    )


class _JsonHandler(logging.StreamHandler):
    """The root handler configure_logging installs (a class of its own, so a second call does not add another)."""


def configure_logging(level: str = "info") -> None:
    """One JSON format for the engine and the gateway: structlog loggers as gateway.logging configures them, and
    stdlib records (the engine's `tokenweir.*` loggers, uvicorn's) rendered by structlog into the same JSON."""
    import structlog

    from gateway.logging import ensure_configured

    ensure_configured(level)
    root = logging.getLogger()
    root.setLevel(level.upper())
    if not any(isinstance(h, _JsonHandler) for h in root.handlers):
        handler = _JsonHandler(sys.stderr)
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=[
                    structlog.stdlib.add_log_level,
                    structlog.stdlib.add_logger_name,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                ],
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(),
                ],
            )
        )
        root.addHandler(handler)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # through the root handler, not their own
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


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
