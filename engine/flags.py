"""The engine server's flags (`tokenweir engine --help`): vLLM's names where vLLM has the flag, the parsers of their
values (dtypes, fractions; sizes in common/engine_flags.py, which the gateway's `serve` reads too), and the
EngineConfig they make. Torch-free: `--help` and `--version` answer without loading torch."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from tokenweir.common.engine_flags import API_KEY_ENV, KV_TRANSFER_KEY_ENV, parse_size
from tokenweir.common.http.door_limits import HttpLimits, add_http_flags
from tokenweir.common.text.tool_prompt import TOOL_CALL_FORMATS
from tokenweir.engine.config import (
    MIN_TRANSFER_KEY_CHARS,
    SCHEDULING_POLICIES,
    EngineConfig,
    KVTransferConfig,
    SpeculativeConfig,
)

# Keep idle connections longer than clients' pools do (httpx expires them after 5 s), so a pooled client never
# sends on a connection the server is closing at that very moment.
KEEP_ALIVE_S = 75
# Far above any request the engine can serve (a full context of token ids is well under 1 MiB), and above the
# gateway's own default bound (4 MiB): only a runaway or hostile body is refused.
MAX_BODY_BYTES = 32 * 1024 * 1024
DTYPES = ("auto", "float32", "float16", "bfloat16")
BATCH_INVARIANT_ENV = "TOKENWEIR_BATCH_INVARIANT"
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's spellings


def parse_dtype(text: str) -> str:
    dtype = _DTYPE_ALIASES.get(text, text)
    if dtype not in DTYPES:
        raise argparse.ArgumentTypeError(f"unsupported dtype {text!r}: choose from {', '.join(DTYPES)}")
    return dtype


def parse_speculative(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_kv_transfer(text: str) -> KVTransferConfig:
    try:
        return KVTransferConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_producers(text: str) -> tuple[str, ...]:
    producers = tuple(p.strip() for p in text.split(",") if p.strip())
    try:
        return KVTransferConfig(kv_producers=producers).kv_producers  # its check of each address
    except AssertionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
        "--api-key",
        default=None,
        help="every route but /health and /metrics needs 'Authorization: Bearer <key>' (default: "
        f"${API_KEY_ENV} if set, else no key is needed); the env variable keeps the key out of `ps`",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the name clients put in `model` (default: the model's own name)"
    )
    p.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=[*TOOL_CALL_FORMATS, "none"],
        help="how the model writes the tool calls it chooses (tool_choice 'auto', the default when tools are sent): "
        "the format the tools are shown in where the chat template does not render them, the grammar that keeps a "
        "call to the offered functions and their schemas, and the parser of its text (vLLM's names); none: "
        "tool_choice 'auto' is refused",
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
        choices=("none", "int8", "w8a8", "gguf", "gguf-a16", "auto"),
        default=d.quantization,
        help="weight format; int8 = int8 weights, one scale per 32 (CPU); w8a8 = int8 weights and, at decode, "
        "activations rounded to int8 per 32 as llama.cpp's Q8_0 (faster, less exact); gguf = a .gguf model's own "
        "Q4_1 / Q8_0 blocks, activations rounded to Q8_1 / Q8_0 as llama.cpp (CPU); gguf-a16 = the same blocks, "
        "activations kept to ~15 bits in two int8 planes (float32's answers, nearly gguf's speed); auto = gguf-a16 "
        "for a .gguf stored as Q4_1, else int8 where a start-up probe shows it faster than dense weights on this CPU",
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
        help="on CUDA: fraction of the GPU's memory this engine may fill, weights and activations included (the KV "
        "cache takes what is left of it); two engines on one GPU take about half each",
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
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=d.enable_chunked_prefill,
        help="cut long prompts into chunks of at most --max-num-batched-tokens, run beside the decoding streams "
        "(off: a prompt is one step, and --max-num-batched-tokens must cover --max-model-len)",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=d.long_prefill_token_threshold,
        help="with chunked prefill, a prompt computes at most this many tokens a step, so short prompts arriving "
        "behind a long one start at once (0: a prompt may take the whole --max-num-batched-tokens)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=d.scheduling_policy,
        help="which waiting request starts next within a priority (a request's priority always comes first): fcfs "
        "or priority, the earliest arrival; shortest-prompt, the one whose prompt would be computed first had it "
        "started when it arrived (a burst's short prompts first, a long prompt passed over only by prompts that "
        "arrived within its own compute time; lowers the median TTFT of mixed bursts, raises the longest ones')",
    )
    p.add_argument(
        "--fairness-output-weight",
        type=float,
        default=d.fairness_output_weight,
        help="token fairness between tenants (VTC): requests carrying the gateway's "
        "x-gateway-inference-fairness-id header start, within a priority, least-served tenant first, served counted "
        "as prompt tokens computed + this weight x output tokens (an output token costs more than a prompt token)",
    )
    p.add_argument(
        "--speculative-config",
        type=parse_speculative,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (also "disable_by_batch_size", "min_acceptance", '
        '"acceptance_window", "retry_after", and "cost_aware": false to check every draft, paying or not); '
        '"method": "ngram_cache" adds an n-gram cache learned across requests; '
        '\'{"model": "draft.gguf", "num_speculative_tokens": 4}\' drafts with a smaller model sharing the '
        "tokenizer (method draft_model); default: off",
    )
    p.add_argument(
        "--kv-transfer-config",
        type=parse_kv_transfer,
        default=None,
        metavar="JSON",
        help='disaggregated prefill, as vLLM\'s: \'{"kv_role": "kv_producer"}\' computes prompts for decode engines '
        '(requests with "kv_transfer_params": {"do_remote_decode": true}) and serves their KV over TCP at "kv_ip" '
        '(127.0.0.1) and "kv_port" (0: any free port), pinned for "pin_timeout_s" (30) at most; "kv_consumer" '
        'fetches the KV a prefill hop\'s answer names (within "fetch_timeout_s", 10; else it computes the prompt) '
        'and decodes; "kv_both" does both; default: off. A consumer fetches only from producers it trusts: answers '
        f"signed with the key the engines share (${KV_TRANSFER_KEY_ENV}, or --kv-transfer-key-file; `tokenweir "
        "serve` gives its engines one), or producers listed in --kv-producers; with neither it computes every prompt",
    )
    p.add_argument(
        "--kv-transfer-key-file",
        default=None,
        metavar="PATH",
        help="a file holding the key the engines of a disaggregated pool share (at least "
        f"{MIN_TRANSFER_KEY_CHARS} characters): a producer signs its answers with it, a consumer fetches the KV of "
        f"signed answers only (default: ${KV_TRANSFER_KEY_ENV}; never on the command line, which `ps` shows)",
    )
    p.add_argument(
        "--kv-producers",
        type=parse_producers,
        default=None,
        metavar="HOST:PORT,...",
        help="a consumer also fetches, signed or not, from the producers at these KV addresses (as their answers "
        'name them: their "kv_ip" and "kv_port")',
    )
    p.add_argument(
        "--attention-backend", choices=["auto", "torch", "triton"], default="auto", help="auto: triton on CUDA"
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get(BATCH_INVARIANT_ENV, "0").strip().lower() in ("1", "true", "yes"),
        help="kernels whose output for a request does not depend on what shares its batch or chunk (on CUDA "
        "fixed-tile Triton GEMMs and row-wise norms, on CPU the projections' own kernels or fixed-shape GEMMs for "
        "every batch and float32 prefill; both: decode rows through the prefill attention kernel): greedy output "
        "is then the same alone, batched, after a prefix-cache hit, across a prefill/decode split and with "
        "speculative decoding, at some speed "
        f"(also ${BATCH_INVARIANT_ENV}=1; as vLLM's VLLM_BATCH_INVARIANT)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch CPU threads (default: all cores but one, left to the HTTP event loop)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="trace generation requests (continuing the W3C traceparent each carries, e.g. a gateway hop's) and send "
        "the spans over OTLP/HTTP to URL, e.g. http://127.0.0.1:4318/v1/traces (vLLM's flag; needs the packages "
        "opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http); default: off",
    )
    p.add_argument(
        "--enable-tracing",
        action="store_true",
        help="trace generation requests as --otlp-traces-endpoint does, printing the spans on stdout (needs "
        "opentelemetry-sdk: the [tracing] extra), unless --otlp-traces-endpoint sends them over OTLP",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="JSON logs on stderr at this level and above (uvicorn's access log included at info)",
    )
    add_http_flags(p, HttpLimits(keep_alive_s=KEEP_ALIVE_S, max_body_bytes=MAX_BODY_BYTES), parse_size)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def api_key(args: argparse.Namespace) -> str | None:
    """The key the API asks for: --api-key, else the env variable (what `tokenweir serve` passes its children)."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def kv_transfer(args: argparse.Namespace) -> KVTransferConfig | None:
    """--kv-transfer-config with whom the engine trusts: the engines' key (from --kv-transfer-key-file, else the env
    variable: what `tokenweir serve` passes its children) and --kv-producers. An unreadable file is an OSError, a key
    too short an AssertionError (as any bad config value)."""
    config = args.kv_transfer_config
    if config is None:
        return None
    key = os.environ.get(KV_TRANSFER_KEY_ENV) or None
    if args.kv_transfer_key_file:
        with open(args.kv_transfer_key_file, encoding="utf-8") as f:
            key = f.read().strip()
    return replace(config, transfer_key=key, kv_producers=args.kv_producers or config.kv_producers)


def tracing_exporter(args: argparse.Namespace) -> str | None:
    """Where the flags send traces (common/tracing.py's exporter names); None: tracing is off."""
    if args.otlp_traces_endpoint:
        return "otlp"
    return "console" if args.enable_tracing else None


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
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        scheduling_policy=args.scheduling_policy,
        fairness_output_weight=args.fairness_output_weight,
        speculative=args.speculative_config,
        kv_transfer=kv_transfer(args),
        attention_backend=None if args.attention_backend == "auto" else args.attention_backend,
        batch_invariant=args.batch_invariant,
        num_threads=args.num_threads,
        seed=args.seed,
    )
