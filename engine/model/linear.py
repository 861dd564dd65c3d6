"""The model's projections as callables `y = proj(x)`, one class per weight format.

- `DenseLinear`: the weight kept pre-transposed ([in, out], contiguous); on CPU, MKL's small-M GEMM is several times
  faster on that layout than on F.linear's [out, in], and decode is all small-M GEMMs.
- `Int8Linear`: int8 weights with one scale per 32 weights of a row (llama.cpp's Q8_0 grouping): a quarter of the
  bytes a float32 decode step reads (half of bfloat16's). `int8` widens them to float32 in our kernel
  (kernels/cpu/int8_linear.cpp, no activation rounding: compute-bound at decode); `w8a8` also rounds the activations
  to int8 at decode, per 32 values of a row with their own scale, and multiplies in integers
  (kernels/cpu/q8_linear.cpp, llama.cpp's Q8_0 x Q8_0 kernel). bfloat16 activations are widened to float32 for the
  call.
  (fbgemm's dynamic int8 linear is faster still but quantizes activations per tensor: SmolLM2's perplexity doubled,
  down_proj's outliers alone took top-1 agreement to 73%. aten's `_weight_int8pack_mm` with bf16 activations takes
  one scale per output channel only: top-1 agreement with float32 fell to 94.9%, under the 95% bar, where groups of
  32 keep 97.4%.)
- `Q4Linear`: `gguf`, the GGUF's own Q4_1 blocks (0.625 bytes a weight, no second rounding), times activations
  rounded to Q8_1 (kernels/cpu/q4_linear.cpp, llama.cpp's Q4_1 x Q8_1 kernel); the file's Q8_0 tensors become
  `Int8Linear`s with their own int8 values and scales, and int8 activations. `gguf-a16`: the same weights, but the
  activations' rounding error kept in a second int8 plane (about 15 bits in all): float32's answers at nearly the
  same speed, since a batch-1 step is bound by reading the weights.

`make_linear` picks the class from the model's compute dtype and the quantization mode.
"""

from __future__ import annotations

import logging
import sys
from functools import cache

import torch

from tokenweir.engine.model.gguf_blocks import GGUFBlocks, concat_rows, pack_q4_1, q8_0_fields
from tokenweir.kernels.cpu import ops as cpu_ops
from tokenweir.kernels.cpu.ops import int8_linear, q8_linear

log = logging.getLogger("tokenweir.engine")
QUANTIZATIONS = ("none", "int8", "w8a8", "gguf", "gguf-a16", "auto")
GGUF_MODES = ("gguf", "gguf-a16")  # the modes that take a .gguf file's own blocks


class DenseLinear:
    __slots__ = ("weight", "batch_invariant")
    # Rows per GEMM call under batch_invariant on CPU: every call has this one shape, so MKL takes one kernel and
    # one blocking for it, and a row's sums run in one order whatever else shares its step.
    CPU_TILE_M = 16

    def __init__(self, weight: torch.Tensor, batch_invariant: bool = False) -> None:
        """batch_invariant: a row's output does not move with the batch: on CUDA the fixed-tile Triton matmul (or
        Triton's interpreter in tests), on CPU GEMMs of CPU_TILE_M rows each (the last tile padded with zeros)."""
        self.weight = weight.t().contiguous()  # [in, out]
        self.batch_invariant = batch_invariant

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:
            return x @ self.weight
        if x.device.type == "cpu":
            return _fixed_tile_matmul(x, self.weight, self.CPU_TILE_M)
        from tokenweir.kernels import batch_invariant  # triton: imported only where it runs

        return batch_invariant.matmul(x, self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def _fixed_tile_matmul(x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
    """x @ weight in GEMMs of `tile` rows, each from a fresh (aligned) copy of its rows: one shape, one alignment,
    so one numeric path for every row."""
    rows = x.shape[0]
    out = torch.empty(rows, weight.shape[1], dtype=torch.result_type(x, weight), device=x.device)
    scratch = x.new_zeros(tile, x.shape[1])
    for start in range(0, rows, tile):
        end = min(start + tile, rows)
        if end - start < tile:
            scratch.zero_()
        scratch[: end - start] = x[start:end]
        out[start:end] = (scratch @ weight)[: end - start]
    return out


GROUP = 32  # weights per scale, as llama.cpp's Q8_0: a row's outliers only coarsen their own group


def _grouped_int8(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per `group` weights of a row (the whole row where `group` does not divide it):
    weight [out, in] -> (int8 [out, in], float32 scales [out, in / group])."""
    w = weight.float()
    out, k = w.shape
    g = group if k % group == 0 else k
    scales = (w.reshape(out, k // g, g).abs().amax(dim=2) / 127).clamp(min=1e-12)
    q = (w.reshape(out, k // g, g) / scales[:, :, None]).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(out, k), scales


def _dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out, k = q.shape
    return (q.reshape(out, scales.shape[1], -1).float() * scales[:, :, None]).reshape(out, k)


class Int8Linear:
    """int8 weights, integer or float32 math. Decode-sized batches (<= SMALL_M rows) run one of the small-M kernels,
    which read each int8 row once: the weight-only one (`int8`), or with `int8_activations` (`w8a8`) the one that
    rounds the activations to int8 per group of 32 (1.34x faster at batch 1 on an AVX2 EPYC, but greedy top-1
    agreement with float32 95.9% against 97.4%, and SmolLM2 stops answering "What is the capital of France?" with
    Paris). Bigger batches (prefill chunks) are compute-bound, so the weight is widened to float32 for that call and
    MKL does the GEMM on float32 activations. Activations of another dtype (bfloat16) are widened and the result
    narrowed back."""

    __slots__ = ("weight", "scales", "int8_activations", "planes", "small_m")
    # the kernels beat dequantize + MKL up to 64 rows on an AVX2 EPYC (tests/contract/kernels, bench notes)
    SMALL_M = 64

    def __init__(self, weight: torch.Tensor, int8_activations: bool = False, batch_invariant: bool = False) -> None:
        self._set(*_grouped_int8(weight), int8_activations, batch_invariant=batch_invariant)

    def _set(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        int8_activations: bool,
        planes: int = 1,
        batch_invariant: bool = False,
    ) -> None:
        self.weight, self.scales, self.planes = weight, scales, planes
        # batch_invariant: every batch through the kernel, whose rows never depend on each other
        self.small_m = sys.maxsize if batch_invariant else self.SMALL_M
        # The integer kernel takes groups of 32 only; a row that 32 does not divide has one scale for the whole row.
        self.int8_activations = int8_activations and self.scales.shape[1] * GROUP == self.weight.shape[1]

    @classmethod
    def from_q8_0(cls, blocks: GGUFBlocks, planes: int = 1, batch_invariant: bool = False) -> Int8Linear:
        """A GGUF Q8_0 tensor as it is: its int8 values and (float16) scales, integer decode kernel with the
        activations in `planes` int8 planes."""
        assert blocks.kind == "Q8_0"
        linear = cls.__new__(cls)
        linear._set(*q8_0_fields(blocks.data), int8_activations=True, planes=planes, batch_invariant=batch_invariant)
        return linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        if x.shape[0] <= self.small_m:
            if self.int8_activations:
                return q8_linear(x, self.weight, self.scales, self.planes).to(dtype)
            return int8_linear(x, self.weight, self.scales).to(dtype)
        return (x @ _dequantize(self.weight, self.scales).t()).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * 4


class Q4Linear:
    """The GGUF's Q4_1 blocks, repacked for the kernel but not rounded again (kernels/cpu/q4_linear.cpp). Batches of
    up to `small_m` rows run the Q4_1 x Q8_1 kernel (activations rounded, as llama.cpp does for every batch); bigger
    ones (prefill chunks) go by `prefill_dtype`: torch.int8 runs them through the prefill kernel
    (kernels/cpu/q4_prefill.cpp: activations rounded to Q8_1 as llama.cpp does, ~1.7x float32 GEMM on AVX2 without
    VNNI); bfloat16 or float32 dequantize the weight to it for that call and multiply dense (bfloat16 on a CPU with
    native bf16: 2-2.3x the two-plane kernel at 128-512 rows on an AVX-512 EPYC). Other activation dtypes are widened.
    planes=2 (`gguf-a16`): the activations' rounding error in a second int8 plane (decode batches)."""

    __slots__ = ("packed", "in_features", "planes", "prefill_dtype", "small_m")
    # One plane beat dequantize + float32 MKL at every M measured, up to 512 rows (1.1-6x, 1 or 2 threads, on
    # SmolLM2's shapes, AMD EPYC), where the measurements stopped. Two planes cost twice the integer dots:
    # float32 MKL wins from about 256 rows, and bfloat16 (dequantized for the call) from 64-128.
    # The int8 prefill kernel is faster from a few rows, but rounds otherwise than the decode kernel (its sums run in
    # another order, and with two planes it drops the second): decode batches and speculative verification rows up to
    # 128 keep the decode kernel: up to there a row's logits do not depend on how many rows share its step (a step
    # with a longer prefill chunk takes its decode rows along, as the dense prefill paths do).
    SMALL_M = {
        (1, torch.float32): 512, (1, torch.bfloat16): 512, (1, torch.int8): 128,
        (2, torch.float32): 128, (2, torch.bfloat16): 64, (2, torch.int8): 128,
    }  # fmt: skip

    def __init__(
        self,
        blocks: GGUFBlocks,
        planes: int = 1,
        prefill_dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ) -> None:
        """batch_invariant: every batch, prefill chunks too, through the decode kernel (its rows never depend on each
        other), at the prefill speed that kernel has."""
        assert blocks.kind == "Q4_1" and planes in (1, 2)
        self.packed, self.in_features, self.planes = pack_q4_1(blocks.data), blocks.in_features, planes
        self.prefill_dtype = prefill_dtype
        self.small_m = sys.maxsize if batch_invariant else self.SMALL_M[planes, prefill_dtype]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if x.shape[0] <= self.small_m:
            return cpu_ops.q4_1_linear(x.float(), self.packed, self.planes).to(dtype)
        if self.prefill_dtype == torch.int8:
            return cpu_ops.q4_1_prefill(x.float(), self.packed).to(dtype)
        weight = cpu_ops.q4_1_dequantize(self.packed, self.in_features, self.prefill_dtype)
        return (x.to(self.prefill_dtype) @ weight.t()).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


Linear = DenseLinear | Int8Linear | Q4Linear


def make_linear(
    weight: torch.Tensor,
    dtype: torch.dtype,
    quantization: str,
    blocks: list[GGUFBlocks | None] | None = None,
    prefill_dtype: torch.dtype = torch.float32,
    batch_invariant: bool = False,
) -> Linear:
    """weight: [out, in] in torch's layout, already in `dtype` on its device. blocks (GGUF_MODES only): the GGUF
    blocks of the tensors `weight` was concatenated from, in order; prefill_dtype: the dense GEMM's dtype for their
    prefill chunks; batch_invariant: a row's output never depends on the rest of its batch (dense CUDA weights in the
    batch-invariant Triton kernel, dense CPU weights in fixed-shape GEMMs, the CPU kernels for every batch size)."""
    assert quantization in QUANTIZATIONS[:-1], f"resolve quantization {quantization!r} before building the model"
    if quantization == "none":
        return DenseLinear(weight, batch_invariant)
    assert weight.device.type == "cpu", "int8 and gguf projections are CPU kernels"
    assert dtype in (torch.float32, torch.bfloat16), f"{quantization} with {dtype} activations has no CPU kernel"
    if quantization in GGUF_MODES:
        planes = 2 if quantization == "gguf-a16" else 1
        return _gguf_linear(weight, blocks or [None], planes, prefill_dtype, batch_invariant)
    return Int8Linear(weight, int8_activations=quantization == "w8a8", batch_invariant=batch_invariant)


def _gguf_linear(
    weight: torch.Tensor,
    blocks: list[GGUFBlocks | None],
    planes: int,
    prefill_dtype: torch.dtype,
    batch_invariant: bool,
) -> Linear:
    fused = concat_rows(blocks)
    if fused is not None and fused.in_features == weight.shape[1] and fused.kind == "Q4_1":
        return Q4Linear(fused, planes, prefill_dtype, batch_invariant)
    if fused is not None and fused.in_features == weight.shape[1] and fused.kind == "Q8_0":
        return Int8Linear.from_q8_0(fused, planes, batch_invariant)
    _warn_dense("+".join(sorted({b.kind if b is not None else "other" for b in blocks})))
    return DenseLinear(weight, batch_invariant)


@cache
def _warn_dense(kinds: str) -> None:
    log.warning("gguf: no kernel for %s blocks: those projections keep dense weights", kinds)
