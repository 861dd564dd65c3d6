"""The engine's one attention interface: write this step's K/V into the paged cache, then attend.

A batch is laid out decodes first (one query token each), then prefill chunks (varlen), so each part runs through the
kernel built for it. The kernels come from kernels/: Triton on CUDA, the torch reference elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenweir.kernels.attention.backend import get_ops, resolve_backend

# Backends whose prefill kernel gives a row the same output in any chunk and batch (the torch reference does not:
# its GEMMs' blocking follows the chunk's shape).
BATCH_INVARIANT_BACKENDS = ("triton", "cpu")


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every token in the batch
    num_decode_tokens: int  # the first D tokens are decodes (one per sequence)
    decode_block_tables: torch.Tensor  # [D, max_blocks]
    decode_context_lens: torch.Tensor  # [D]
    prefill_block_tables: torch.Tensor  # [P, max_blocks]
    prefill_cu_seqlens_q: torch.Tensor  # [P + 1], offsets into the prefill tokens
    prefill_context_lens: torch.Tensor  # [P], cached + computed + this chunk
    prefill_max_q: int = 0  # longest chunk: sizes the Triton grid without a device->host sync

    @classmethod
    def one_prefill(cls, start: int, end: int, num_blocks: int, device: torch.device | str = "cpu"):
        """Positions [start, end) of one sequence whose blocks are 0..num_blocks-1 in order (slot == position): the
        layout of a throwaway KV pool (warm-up, perplexity), not of the engine's shared one."""
        positions = torch.arange(start, end, device=device)
        return cls(
            slot_mapping=positions,
            num_decode_tokens=0,
            decode_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=device),
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
            prefill_block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
            prefill_cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            prefill_context_lens=torch.tensor([end], dtype=torch.int32, device=device),
            prefill_max_q=end - start,
        )


class PagedAttention:
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: str | None = None,
        prefill_dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ) -> None:
        """prefill_dtype: bfloat16 lets the "cpu" backend's prefill kernel take bfloat16 dot products (the GEMMs of
        such a chunk round to bfloat16 already). batch_invariant: decode rows run through the prefill kernel as
        chunks of one token, so a position's attention is computed the same way whether it was a prompt token, a
        decode step, a draft under verification or a token recomputed after preemption, in a batch of any size (on
        Triton the decode kernel's split-K depends on the batch and its tiles differ from the prefill kernel's; on
        the "cpu" backend the decode kernel sums in another order than the prefill kernel, whose row never depends
        on the rest of its chunk, and the prefill chunks stay float32)."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = resolve_backend(backend)
        self.ops = get_ops(self.backend)
        # Backend-only arguments (the torch reference takes neither).
        self.pass_max_seqlen_q = self.backend == "triton"
        self.decode_as_prefill = batch_invariant and self.backend in BATCH_INVARIANT_BACKENDS
        self.prefill_bf16 = self.backend == "cpu" and prefill_dtype == torch.bfloat16 and not self.decode_as_prefill
        self._one_each = torch.empty(0, dtype=torch.int32)  # 0..n: decode rows as one-token chunks, grown as needed

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq, D]."""
        self.ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:
            return self._decode(q, k_cache, v_cache, meta)
        extra = {"max_seqlen_q": meta.prefill_max_q} if self.pass_max_seqlen_q else {}
        if self.prefill_bf16:
            extra["bf16"] = True
        prefill_out = self.ops.paged_prefill_attention(
            q[num_decode:],
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_cu_seqlens_q,
            meta.prefill_context_lens,
            self.scale,
            **extra,
        )
        if num_decode == 0:
            return prefill_out
        return torch.cat([self._decode(q[:num_decode], k_cache, v_cache, meta), prefill_out])

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata):
        tables, context = meta.decode_block_tables, meta.decode_context_lens
        if not self.decode_as_prefill:
            return self.ops.paged_decode_attention(q, k_cache, v_cache, tables, context, self.scale)
        if self._one_each.numel() <= q.shape[0] or self._one_each.device != q.device:
            self._one_each = torch.arange(2 * q.shape[0] + 1, dtype=torch.int32, device=q.device)
        extra = {"max_seqlen_q": 1} if self.pass_max_seqlen_q else {}
        return self.ops.paged_prefill_attention(
            q, k_cache, v_cache, tables, self._one_each[: q.shape[0] + 1], context, self.scale, **extra
        )
