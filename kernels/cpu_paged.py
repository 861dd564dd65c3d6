"""The "cpu" attention backend: decode through the C++ paged kernel (kernels/cpu/paged_decode.cpp), which reads K/V
in place through the block table, and everything else (KV write, chunked prefill, non-float32 decode) through the
torch reference. Chosen by `auto` on machines where the CPU kernels build."""

import torch

from kernels import cpu_ops, reference
from kernels.reference import paged_prefill_attention, store_kv

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]


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
