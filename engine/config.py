"""Engine and model configuration as plain dataclasses."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from tokenweir.common.engine_flags import DEFAULT_GPU_MEMORY_UTILIZATION

SCHEDULING_POLICIES = ("fcfs", "priority", "shortest-prompt")
MIN_TRANSFER_KEY_CHARS = 16  # `tokenweir serve` makes 64 hex digits


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, SmolLM2, Mistral-style GQA, Qwen2-style qkv bias)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "model"
    layer_formats: frozenset[str] = frozenset()  # GGUF storage types of the per-layer matrices; empty for HF weights

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "query heads must be a multiple of KV heads"


@dataclass
class SpeculativeConfig:
    """Speculative decoding, vLLM's `--speculative-config` JSON: each step a decoding sequence proposes up to
    `num_speculative_tokens` draft tokens, the model checks them all in one forward, and the ones the target model
    would have produced are kept (with one more token of its own), so a step can emit several tokens.

    method "ngram" (prompt lookup): the drafts are what followed the latest earlier occurrence of the sequence's last
    n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) in its prompt and output so far. Method
    "ngram_cache" adds, where that finds nothing, the most frequent continuations in an n-gram cache learned from the
    outputs of finished requests (`cache_capacity` n-grams, least recently seen forgotten first). Drafting stops
    for the whole batch above `disable_by_batch_size` running sequences (a big batch is already compute-bound) and for
    a sequence whose drafts keep failing (its acceptance below `min_acceptance` over its last `acceptance_window`
    proposed tokens; it tries again `retry_after` tokens later). With `cost_aware` (the default) each step keeps only
    the drafts whose expected accepted tokens pay for their verification rows at the step cost measured on this
    device (engine/spec_decode/draft_budget.py); false checks every draft (to measure the lever's raw effect).

    Method "draft_model" (vLLM infers it from a `model` key): a smaller model with the target's tokenizer, at `model`
    (a .gguf file or a HF directory), proposes the drafts greedily from a KV cache of its own (as many blocks as the
    target's pool; `draft_num_kv_blocks` sets it)."""

    method: str = "ngram"
    model: str | None = None  # the draft model (method draft_model)
    draft_num_kv_blocks: int | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = 8
    min_acceptance: float = 0.2
    acceptance_window: int = 32
    retry_after: int = 64
    cache_capacity: int = 200_000
    cost_aware: bool = True

    def __post_init__(self) -> None:
        methods = ("ngram", "ngram_cache", "draft_model")
        assert self.method in methods, f"speculative method: one of {', '.join(methods)}, got {self.method!r}"
        assert (self.method == "draft_model") == bool(self.model), (
            'method "draft_model" takes the draft model\'s path as "model"; the n-gram methods take none'
        )
        assert self.draft_num_kv_blocks is None or self.draft_num_kv_blocks >= 1
        assert 1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens: 1 to 16"
        assert 1 <= self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min: 1 to prompt_lookup_max"
        assert self.disable_by_batch_size is None or self.disable_by_batch_size >= 1
        assert 0 <= self.min_acceptance <= 1 and self.acceptance_window >= 1 and self.retry_after >= 0
        assert self.cache_capacity >= 1

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """From vLLM's JSON form; an unknown key or a bad value is a ValueError naming it."""
        return _dataclass_from_json(cls, text, "--speculative-config", '{"method": "ngram", ...}')

    def describe(self) -> str:
        source = f"model={self.model}" if self.model else f"n={self.prompt_lookup_min}..{self.prompt_lookup_max}"
        budget = "drafts kept where they pay" if self.cost_aware else "every draft checked"
        return (
            f"{self.method} k={self.num_speculative_tokens} {source} off above {self.disable_by_batch_size} running, "
            f"{budget}"
        )


@dataclass
class KVTransferConfig:
    """Disaggregated prefill, vLLM's `--kv-transfer-config` JSON. A `kv_producer` computes prompts for decode engines:
    a request whose `kv_transfer_params` say `do_remote_decode` keeps its prompt's KV blocks pinned when it finishes
    (for `pin_timeout_s` at most, or until fetched) and its output says where to fetch them; the blocks are served over
    TCP at `kv_ip`:`kv_port` (port 0: any free one). A `kv_consumer` takes requests whose `kv_transfer_params` say
    `do_remote_prefill`: it fetches the prompt's blocks from that producer (a fetch that fails or passes
    `fetch_timeout_s` falls back to computing the prompt itself), then decodes. `kv_both` is both.

    A consumer fetches only from producers it trusts (engine/kv_transfer/trust.py): answers signed with
    `transfer_key`, the key the engines share (a producer signs its answers with it), or naming an address of
    `kv_producers` ("host:port", as the producer's answers name it); with neither, it trusts no producer. The key is a
    secret: the flags read it from the environment or a file, never from the command line."""

    kv_role: str = "kv_both"
    kv_connector: str = "TcpConnector"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    pin_timeout_s: float = 30.0
    fetch_timeout_s: float = 10.0
    transfer_key: str | None = field(default=None, repr=False)
    kv_producers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        roles = ("kv_producer", "kv_consumer", "kv_both")
        assert self.kv_role in roles, f"kv_role: one of {', '.join(roles)}, got {self.kv_role!r}"
        assert self.kv_connector == "TcpConnector", f"kv_connector: TcpConnector, got {self.kv_connector!r}"
        assert 0 <= self.kv_port <= 65535, f"kv_port: 0 to 65535, got {self.kv_port}"
        assert self.pin_timeout_s > 0 and self.fetch_timeout_s > 0, "pin_timeout_s and fetch_timeout_s: above 0"
        assert self.transfer_key is None or len(self.transfer_key) >= MIN_TRANSFER_KEY_CHARS, (
            f"the KV transfer key: {MIN_TRANSFER_KEY_CHARS} characters at least"
        )
        self.kv_producers = tuple(self.kv_producers)
        for address in self.kv_producers:
            host, _, port = str(address).rpartition(":")
            assert host and port.isdigit() and 0 < int(port) < 65536, f"kv_producers: host:port, got {address!r}"

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """From vLLM's JSON form; an unknown key or a bad value is a ValueError naming it. The transfer key is
        refused there: a command line is visible to every local user (`ps`)."""
        return _dataclass_from_json(cls, text, "--kv-transfer-config", '{"kv_role": "kv_producer"}', ("transfer_key",))

    def describe(self) -> str:
        return f"{self.kv_role} over {self.kv_connector} at {self.kv_ip}:{self.kv_port or 'any port'}"


@dataclass
class EngineConfig:
    model: str = ""  # a .gguf file or a HF directory; empty = the default model
    served_model_name: str | None = None
    dtype: str = "auto"  # auto = bfloat16 on CUDA and on CPUs with native bf16 (probed), else float32
    quantization: str = "auto"  # none|int8|w8a8|gguf|gguf-a16|auto (gguf-a16 for a Q4_1 .gguf, else int8 if faster)
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size; else sized from kv_cache_memory
    kv_cache_memory: int = 512 * 2**20  # bytes for K and V of all layers (CPU); on CUDA see gpu_memory_utilization
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024  # a step's tokens: prefill chunks of up to this many
    max_model_len: int | None = None  # default: the model's context, capped by the pool
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True  # off: a prompt is computed in one step, never cut into chunks
    long_prefill_token_threshold: int = 0  # a prompt's chunk at most this many tokens a step; 0: the step's budget
    # which waiting request starts next, within a priority: "fcfs" (or "priority": the same) the earliest arrival;
    # "shortest-prompt" the one whose prompt would be done first if started at its arrival (Scheduler.admission_key)
    scheduling_policy: str = "fcfs"
    # token fairness between the gateway's tenants (engine/sched/fairness.py, VTC): an output token counts this many
    # prompt tokens in a tenant's service (2.0, as in the VTC paper's experiments)
    fairness_output_weight: float = 2.0
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    kv_transfer: KVTransferConfig | None = None  # None: no disaggregated prefill
    attention_backend: str | None = None  # torch | triton | None (auto: triton on CUDA)
    # CUDA: kernels whose output for a row does not depend on the batch (speculation then gives plain decoding's
    # tokens exactly); the CPU kernels are so already
    batch_invariant: bool = False
    num_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, "block_size: a power of two"
        assert self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold: 0 (off) or more"
        assert self.fairness_output_weight >= 0, "fairness_output_weight: 0 or more"
        assert self.scheduling_policy in SCHEDULING_POLICIES, (
            f"scheduling_policy: one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
        )
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "num_threads"):
            value = getattr(self, name)
            assert value is None or value >= 1, f"{name}: at least 1, got {value}"
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            assert self.max_num_batched_tokens >= self.max_model_len, (
                "without chunked prefill a whole prompt is one step: max_num_batched_tokens must be >= max_model_len"
            )
        modes = ("none", "int8", "w8a8", "gguf", "gguf-a16", "auto")
        assert self.quantization in modes, f"quantization: one of {', '.join(modes)}"


def _dataclass_from_json(cls, text: str, flag: str, example: str, secrets: tuple[str, ...] = ()):
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{flag}: a JSON object, e.g. '{example}'")
    if given := sorted(set(raw) & set(secrets)):
        raise ValueError(f"{flag}: {given} is a secret: give it in the environment or a file, not on the command line")
    if cls is SpeculativeConfig and raw.get("model") and "method" not in raw:
        raw["method"] = "draft_model"  # as vLLM infers it
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{flag}: unknown key(s) {unknown}; known: {sorted(known)}")
    try:
        return cls(**raw)
    except (AssertionError, TypeError) as e:
        raise ValueError(f"{flag}: {e}") from None
