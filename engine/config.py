"""Engine and model configuration as plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass

from tokenweir.common.engine_flags import DEFAULT_GPU_MEMORY_UTILIZATION


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
    attention_backend: str | None = None  # torch | triton | None (auto: triton on CUDA)
    num_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, "block_size: a power of two"
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "num_threads"):
            value = getattr(self, name)
            assert value is None or value >= 1, f"{name}: at least 1, got {value}"
        modes = ("none", "int8", "w8a8", "gguf", "gguf-a16", "auto")
        assert self.quantization in modes, f"quantization: one of {', '.join(modes)}"
