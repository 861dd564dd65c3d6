"""Llama-family decoder over a paged KV cache.

q/k/v and gate/up are fused into one projection each (fewer, wider GEMMs); every projection is an
engine.model.linear callable, so the same layer runs dense float32 / bfloat16, int8 weights or a GGUF's own blocks
(`blocks`: canonical name -> GGUFBlocks, from engine.model.loader.load_gguf_blocks, for `gguf` and `gguf-a16`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenweir.engine.config import ModelConfig
from tokenweir.engine.model.attention import AttentionMetadata, PagedAttention
from tokenweir.engine.model.gguf_blocks import GGUFBlocks
from tokenweir.engine.model.linear import GGUF_MODES, make_linear
from tokenweir.kernels.attention.backend import resolve_backend
from tokenweir.kernels.cpu import ops as cpu_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def norm_for(batch_invariant: bool):
    """rms_norm, or with batch_invariant the Triton kernel that normalises each row in one program (on CUDA, torch's
    reduction shares a row among threads by the number of rows, so a row's scale moves in the last bit with it)."""
    if not batch_invariant:
        return rms_norm
    from tokenweir.kernels import batch_invariant as kernels  # triton: imported only where it runs

    return kernels.rms_norm


def has_batch_invariant_kernels(backend: str, dtype: torch.dtype, config: ModelConfig) -> bool:
    """Triton's batch-invariant kernels, or the "cpu" backend's C++ kernels where they run (float32, head_dim 64):
    their rows never depend on the rest of the batch (the norms and element-wise kernels work row by row, the
    projections' kernels too, the prefill attention kernel's tiles sit at fixed key positions)."""
    if backend == "triton":
        return True
    return backend == "cpu" and dtype == torch.float32 and config.head_dim == 64 and cpu_ops.load() is not None


def rope_cos_sin(head_dim: int, theta: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Same arithmetic as HF's LlamaRotaryEmbedding (float32, rotate-half layout), so greedy tokens match.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class DecoderLayer:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        attention: PagedAttention,
        quantization: str = "none",
        blocks: dict[str, GGUFBlocks] | None = None,
        prefill_dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ) -> None:
        self.config = config
        dtype = weights["o_proj"].dtype
        self.attention = attention
        self.input_norm = weights["input_norm"]
        self.post_attention_norm = weights["post_attention_norm"]

        def linear(*names: str):
            parts = [(blocks or {}).get(n) for n in names]
            weight = torch.cat([weights[n] for n in names])
            return make_linear(weight, dtype, quantization, parts, prefill_dtype, batch_invariant)

        self.qkv_proj = linear("q_proj.weight", "k_proj.weight", "v_proj.weight")
        self.qkv_bias = (
            torch.cat([weights["q_proj.bias"], weights["k_proj.bias"], weights["v_proj.bias"]])
            if config.qkv_bias
            else None
        )
        self.o_proj = linear("o_proj")
        self.gate_up_proj = linear("gate_proj", "up_proj")
        self.down_proj = linear("down_proj")
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # The "cpu" attention backend brings C++ element-wise kernels too: one call each for the norms, RoPE and
        # SiLU-gating instead of ~30 tiny torch ops per layer, whose dispatch dominates a batch-1 step.
        self.fused = cpu_ops.load() if attention.backend == "cpu" and dtype == torch.float32 else None
        self.norm = norm_for(batch_invariant and attention.backend == "triton")

    def projections(self) -> list:
        return [self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj]

    def __call__(self, hidden, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if self.fused is not None:
            return self._fused_call(hidden, cos, sin, k_cache, v_cache, meta)
        cfg = self.config
        x = self.norm(hidden, self.input_norm, cfg.rms_norm_eps)
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        attn = self.attention(q, k, v, k_cache, v_cache, meta)
        hidden = hidden + self.o_proj(attn.reshape(-1, self.q_size))
        x = self.norm(hidden, self.post_attention_norm, cfg.rms_norm_eps)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up)

    def _fused_call(self, hidden, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        cfg, ops = self.config, self.fused
        assert ops is not None  # __call__ comes here only with the fused kernels loaded
        qkv = self.qkv_proj(ops.rms_norm(hidden, self.input_norm, cfg.rms_norm_eps))
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        ops.rope_(qkv, cos, sin, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)  # q and k heads, in place
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        attn = self.attention(
            q.view(-1, cfg.num_heads, cfg.head_dim),
            k.view(-1, cfg.num_kv_heads, cfg.head_dim),
            v.view(-1, cfg.num_kv_heads, cfg.head_dim),
            k_cache,
            v_cache,
            meta,
        )
        hidden = hidden + self.o_proj(attn.reshape(-1, self.q_size))
        gated = ops.silu_mul(self.gate_up_proj(ops.rms_norm(hidden, self.post_attention_norm, cfg.rms_norm_eps)))
        return hidden + self.down_proj(gated)


class LlamaForCausalLM:
    def __init__(
        self,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attention_backend: str | None = None,
        max_positions: int | None = None,
        quantization: str = "none",
        blocks: dict[str, GGUFBlocks] | None = None,
        prefill_dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ) -> None:
        """prefill_dtype: how prefill chunks of the GGUF's own blocks multiply (gguf modes): dense GEMMs in float32 or
        bfloat16, or torch.int8 for the int8 prefill kernel;
        batch_invariant: kernels that give a row the same output in any batch and chunk (projections, norms, decode
        rows through the prefill attention kernel), so speculative decoding's verification rows equal plain
        decoding's rows and a prompt's answer does not depend on where or with what it was computed: with the Triton
        backend (CUDA, or Triton's interpreter in tests) and with the "cpu" backend where its C++ kernels run
        (float32, head_dim 64); elsewhere (the torch reference) it is logged as unavailable."""
        assert quantization not in GGUF_MODES or blocks is not None, "gguf: pass the GGUF's blocks (load_gguf_blocks)"
        self.config = config
        self.quantization = quantization
        blocks = blocks or {}
        state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
        backend = resolve_backend(attention_backend)
        self.batch_invariant = batch_invariant = batch_invariant and has_batch_invariant_kernels(backend, dtype, config)
        attention = PagedAttention(
            config.num_heads, config.num_kv_heads, config.head_dim, backend, prefill_dtype, batch_invariant
        )
        self.attention_backend = attention.backend
        self.rms_norm = norm_for(batch_invariant and backend == "triton")
        self.embed_tokens = state["embed_tokens"]
        lm_head = "embed_tokens" if config.tie_word_embeddings else "lm_head"
        self.lm_head = make_linear(
            state[lm_head], dtype, quantization, [blocks.get(lm_head)], batch_invariant=batch_invariant
        )
        self.norm = state["norm"]
        self.layers = []
        for i in range(config.num_layers):
            prefix = f"layers.{i}."
            weights = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
            layer_blocks = {k.removeprefix(prefix): v for k, v in blocks.items() if k.startswith(prefix)}
            self.layers.append(
                DecoderLayer(config, weights, attention, quantization, layer_blocks, prefill_dtype, batch_invariant)
            )
        cos, sin = rope_cos_sin(config.head_dim, config.rope_theta, max_positions or config.max_position_embeddings)
        self.rope_cos, self.rope_sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns float32 logits [len(logits_indices), vocab]."""
        hidden = self.embed_tokens[input_ids]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, k_cache, v_cache, meta)
        fused = self.layers[0].fused if self.layers else None
        norm = fused.rms_norm if fused is not None else self.rms_norm
        hidden = norm(hidden[logits_indices], self.norm, self.config.rms_norm_eps)
        return self.lm_head(hidden).float()

    def scratch_kv(self, tokens: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A zeroed KV pool of its own for one sequence of `tokens` (per layer K and V, the engine's block layout)."""
        cfg, like = self.config, self.rope_cos
        shape = (-(-tokens // block_size), block_size, cfg.num_kv_heads, cfg.head_dim)
        return [
            (
                torch.zeros(shape, dtype=like.dtype, device=like.device),
                torch.zeros(shape, dtype=like.dtype, device=like.device),
            )
            for _ in range(cfg.num_layers)
        ]

    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one decode step reads (every projection once; embeddings are row lookups)."""
        projections = [p for layer in self.layers for p in layer.projections()] + [self.lm_head]
        return sum(p.nbytes for p in projections)
