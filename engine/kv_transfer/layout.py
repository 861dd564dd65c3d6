"""What both ends of a KV transfer must agree on, checked before a byte of KV moves: the same weights (a digest of the
model's files, and how they are quantized, since that changes the K/V values), the cache's dtype and block size, and
the shape of a block. A block travels as [2 (k, v), layers, block_size, kv_heads, head_dim] in the cache's dtype."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch


@dataclass(frozen=True)
class KVLayout:
    model_digest: str
    weights: str  # the quantization mode the model runs in
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor, model_digest: str, weights: str) -> KVLayout:
        """Of a pool shaped [2, layers, blocks, block_size, kv_heads, head_dim]."""
        _, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        return cls(model_digest, weights, dtype, block_size, num_layers, num_kv_heads, head_dim)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (2, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        count = 1
        for n in self.block_shape:
            count *= n
        return count * self.torch_dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def mismatch(self, other: dict[str, Any]) -> str | None:
        """What differs in the other end's layout, or None where the two agree."""
        differ = [f"{f.name} {other.get(f.name)!r} != {getattr(self, f.name)!r}" for f in fields(self)]
        differ = [d for d, f in zip(differ, fields(self), strict=True) if other.get(f.name) != getattr(self, f.name)]
        return "; ".join(differ) or None


def prompt_digest(token_ids: list[int]) -> str:
    """Names a prompt's tokens: a transfer serves the blocks of the very prompt the consumer holds."""
    return hashlib.blake2b(",".join(map(str, token_ids)).encode(), digest_size=16).hexdigest()
