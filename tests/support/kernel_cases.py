"""Paged-cache fixtures and a dense, obviously-correct attention for the kernel tests."""

from dataclasses import dataclass

import torch

from tokenweir.kernels.attention import reference

# Interpreted Triton on CPU (fp32 only there); compiled kernels when a GPU is present. Tests stay fp32 on both.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class PagedBatch:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], NaN wherever no sequence wrote
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, shuffled block ids, -1 past each context
    context_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence, dense [L, Hkv, D]
    values: list[torch.Tensor]


def make_paged_batch(
    lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, gen: torch.Generator
) -> PagedBatch:
    """Random K/V for each sequence written through store_kv into shuffled blocks of a NaN-poisoned cache.

    Cache, tables and lengths live on DEVICE; the dense keys/values stay on CPU for naive_attention.
    """
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, (n, nb) in enumerate(zip(lens, blocks_per_seq, strict=True)):
        ids = order[used : used + nb]
        used += nb
        block_tables[b, :nb] = ids.int()
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        pos = torch.arange(n)
        slots = ids[pos // block_size] * block_size + pos % block_size
        reference.store_kv(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    return PagedBatch(
        k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE), context_lens.to(DEVICE), keys, values
    )


def randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    """Seeded on CPU, then moved, so CPU and GPU runs draw the same numbers."""
    return torch.randn(*shape, generator=gen).to(DEVICE)


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense float64 attention: q [n, Hq, D] at absolute positions [n] sees keys 0..position of k/v [L, Hkv, D].

    Computed on CPU; the result is returned on DEVICE to compare with kernel outputs.
    """
    q, positions = q.cpu(), positions.cpu()
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.arange(k.shape[0])[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float().to(DEVICE)
