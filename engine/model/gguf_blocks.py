"""A GGUF tensor's quantized blocks, kept as the file stores them, and their unpacking for our kernels.

`--quantization gguf` multiplies by the file's own blocks instead of requantizing the dequantized float32 weights
(a second rounding, which cost quality): Q4_1 projections go to kernels/cpu/q4_linear.cpp in the row layout
`pack_q4_1` makes; Q8_0 tensors (SmolLM2's tied lm_head) map exactly onto q8_linear's int8 weights and scales.

Block formats (ggml): Q4_1 = float16 d, float16 m, 16 bytes of nibbles (byte k: value k in the low nibble, value
k + 16 in the high one), w = d * q + m; Q8_0 = float16 d, 32 int8, w = d * q. A tensor's blocks are rows of
[out, in / 32 * block bytes] uint8, in torch's [out, in] order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32  # weights per block
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
GROUP = 8  # Q4_1 blocks whose nibbles q4_linear.cpp interleaves


@dataclass(frozen=True, slots=True)
class GGUFBlocks:
    kind: str  # a key of BLOCK_BYTES
    data: torch.Tensor  # uint8 [out, in / 32 * BLOCK_BYTES[kind]]

    def __post_init__(self) -> None:
        assert self.kind in BLOCK_BYTES, f"no kernel for {self.kind} blocks"
        assert self.data.dtype == torch.uint8 and self.data.dim() == 2
        assert self.data.shape[1] % BLOCK_BYTES[self.kind] == 0, "rows of whole blocks"

    @property
    def in_features(self) -> int:
        return self.data.shape[1] // BLOCK_BYTES[self.kind] * QK


def concat_rows(parts: list[GGUFBlocks | None]) -> GGUFBlocks | None:
    """One tensor of the parts' rows (a fused projection), or None where they are not all blocks of one format."""
    blocks = [p for p in parts if p is not None]
    if not parts or len(blocks) != len(parts) or len({(p.kind, p.data.shape[1]) for p in blocks}) != 1:
        return None
    return GGUFBlocks(blocks[0].kind, torch.cat([p.data for p in blocks]))


def _blocks(data: torch.Tensor, kind: str) -> torch.Tensor:
    return data.reshape(data.shape[0], -1, BLOCK_BYTES[kind])


def _halves(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] float16 (little-endian, as the file)."""
    return raw.contiguous().view(torch.float16)[..., 0]


def q4_1_fields(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows -> (nibble bytes uint8 [out, blocks, 16], d float16 [out, blocks], m float16 [out, blocks])."""
    blocks = _blocks(data, "Q4_1")
    return blocks[..., 4:], _halves(blocks[..., 0:2]), _halves(blocks[..., 2:4])


def dequantize_q4_1(data: torch.Tensor) -> torch.Tensor:
    """Q4_1 rows -> float32 [out, in]: d * q + m, as gguf.quants.dequantize."""
    nibbles, d, m = q4_1_fields(data)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()  # values 0..15, then 16..31
    return (d.float()[..., None] * q + m.float()[..., None]).reshape(data.shape[0], -1)


def pack_q4_1(data: torch.Tensor) -> torch.Tensor:
    """Q4_1 rows -> the row layout of kernels/cpu/q4_linear.cpp, 20 bytes a block as in the file:
    [nibbles, every full group of 8 blocks interleaved by 4-byte words][float16 d of each block][float16 m]."""
    nibbles, d, m = q4_1_fields(data)
    out, blocks = d.shape
    full = blocks // GROUP * GROUP
    # Word t of block j moves to (t, j): lane j of each 32-byte vector then holds block j.
    grouped = nibbles[:, :full].reshape(out, -1, GROUP, 4, 4).transpose(2, 3).reshape(out, -1)
    tail = nibbles[:, full:].reshape(out, -1)
    halves = [h.contiguous().view(torch.uint8).reshape(out, -1) for h in (d, m)]
    return torch.cat([grouped, tail, *halves], dim=1).contiguous()


def q8_0_fields(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows -> (int8 [out, in], float32 scales [out, in / 32]): q8_linear's weights, exactly."""
    blocks = _blocks(data, "Q8_0")
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(data.shape[0], -1)
    return q, _halves(blocks[..., 0:2]).float()
