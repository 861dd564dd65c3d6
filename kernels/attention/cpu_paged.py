"""The "cpu" attention backend: the KV write and decode through the C++ kernels (kernels/cpu/store_kv.cpp, and
kernels/cpu/paged_decode.cpp, which reads K/V in place through the block table), chunked prefill through
kernels/cpu/paged_prefill.cpp (flash-style, AVX-512, head_dim 64; bfloat16 dot products where asked and the CPU has
them), and everything else (a KV write that converts dtypes, non-float32 attention, other head sizes or CPUs) through
the torch reference. Chosen by `auto` on machines where the CPU kernels build."""

import torch

from tokenweir.kernels.attention import reference
from tokenweir.kernels.cpu import ops as cpu_ops

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [N, Hkv, D] into the caches at slot_mapping [N]; slot -1 is padding, skipped."""
    # The kernel declines copies that convert dtypes (the reference's .to(cache dtype)) or odd layouts: rare.
    if not cpu_ops.store_kv(key, value, k_cache, v_cache, slot_mapping):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    del num_splits  # a GPU occupancy knob; accepted so every backend shares one signature
    if q.dtype != torch.float32 or q.shape[0] == 0:
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return cpu_ops.paged_decode_attention(
        q, k_cache, v_cache, block_tables.to(torch.int32), context_lens.to(torch.int32), scale
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    bf16: bool = False,
) -> torch.Tensor:
    """bf16: bfloat16 dot products summed in float32 (the engine's bfloat16-prefill mode), where the kernel has them."""
    out = None
    if q.shape[0] > 0:
        tables = block_tables.to(torch.int32).contiguous()
        cu, lens = cu_seqlens_q.to(torch.int32), context_lens.to(torch.int32)
        out = cpu_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, bf16)
    if out is None:
        return reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
    return out
