"""The CPU kernels of this folder (int8 and Q4_1 GEMMs, paged decode attention, KV cache write), compiled once per
machine with the local C++ compiler.

kernels/cpu/build.py caches the library under the user's cache dir (TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions/tokenweir), keyed by the sources' content, the flags, torch and the CPU, so only the first
load of these sources on a machine pays the 1-4 minute compile (scripts/setup.sh does it), and moving the checkout
does not. A start waits for a build at most TOKENWEIR_KERNEL_BUILD_TIMEOUT_S (300 s), logging its progress.
`-march=native` picks AVX2/FMA where the CPU has them; elsewhere the kernels' scalar loops run. `load()` returns None
where there is no compiler, the build fails or outlasts that bound, and the engine then keeps dense weights and the
torch attention.

TOKENWEIR_CPU_ISA=avx2 runs the engine as on a CPU of the AVX2 class (AMD EPYC before Zen 4, most desktops): the
kernels built for x86-64-v3 (AVX2, FMA, F16C; no AVX-512, no VNNI; cached apart), the precision choices made as
without avx512*/amx/avx_vnni flags (engine/model/precision.py), and torch's own CPU paths held to AVX2
(ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA, unless set). For measuring that class on a machine
that has more; `native` (the default) uses everything this CPU has.
"""

from __future__ import annotations

import glob
import os
from functools import cache

import torch

from tokenweir.kernels.cpu import build

NAME = "tokenweir_cpu_ops"
ISA_ENV = "TOKENWEIR_CPU_ISA"
ISA_MARCH = {"native": "-march=native", "avx2": "-march=x86-64-v3"}
# what the AVX2 class lacks, as /proc/cpuinfo names it
ISA_FLAGS_OFF = {"native": (), "avx2": ("avx512", "amx", "avx_vnni")}
TORCH_ISA_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def cpu_isa() -> str:
    isa = os.environ.get(ISA_ENV, "") or "native"
    assert isa in ISA_MARCH, f"{ISA_ENV}: one of {', '.join(ISA_MARCH)}, got {isa!r}"
    return isa


def hold_torch_to_isa() -> None:
    """Under TOKENWEIR_CPU_ISA=avx2, torch's own kernels too (call before the first torch op: each reads it once)."""
    if cpu_isa() == "avx2":
        for name, value in TORCH_ISA_ENV.items():
            os.environ.setdefault(name, value)


CFLAGS = ["-O3", ISA_MARCH[cpu_isa()], "-fopenmp"]
LDFLAGS = ["-fopenmp"]
# next to this file; the build cache key digests their names and content, not this folder's path
SOURCES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "*.cpp")))
HEADERS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "*.h")))


@cache
def load():
    """The compiled module, or None where it cannot be had (no compiler, a failed build, or one still running after
    TOKENWEIR_KERNEL_BUILD_TIMEOUT_S)."""
    return build.load_extension(NAME, SOURCES, HEADERS, CFLAGS, LDFLAGS, label="CPU kernels")


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32, weight [N, K] int8, scales [N, groups] float32 -> [M, N] float32."""
    module = load()
    assert module is not None, "the CPU kernels could not be built on this machine"
    return module.int8_linear(x, weight, scales)


def q8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, planes: int = 1) -> torch.Tensor:
    """x [M, K] float32 rounded to int8 per 32 values of a row, weight [N, K] int8, scales [N, K / 32] float32 ->
    [M, N] float32, by integer dot products (llama.cpp's Q8_0 x Q8_0 decode kernel). planes=2: the activations'
    rounding error in a second int8 plane, about 15 bits in all."""
    module = load()
    assert module is not None, "the CPU kernels could not be built on this machine"
    return module.q8_linear(x, weight, scales, planes)


def q4_1_linear(x: torch.Tensor, packed: torch.Tensor, planes: int = 1) -> torch.Tensor:
    """x [M, K] float32 rounded to Q8_1 per 32 values of a row, packed [N, K / 32 * 20] uint8 Q4_1 rows
    (engine/model/gguf_blocks.py's pack_q4_1) -> [M, N] float32, by integer dot products (llama.cpp's Q4_1 x Q8_1
    kernel). planes=2: the activations' rounding error in a second int8 plane, about 15 bits in all."""
    module = load()
    assert module is not None, "the CPU kernels could not be built on this machine"
    return module.q4_1_linear(x, packed, planes)


def q4_1_prefill(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """q4_1_linear(x, packed) with one plane, for prefill chunks (many rows): the same maths, laid out so that
    8-bit products run at about twice float32 GEMM's speed on a CPU without VNNI or native bf16
    (kernels/cpu/q4_prefill.cpp). Equal to q4_1_linear to float rounding, not bit for bit."""
    module = load()
    assert module is not None, "the CPU kernels could not be built on this machine"
    return module.q4_1_prefill(x, packed)


def q4_1_dequantize(packed: torch.Tensor, in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed Q4_1 rows [N, K / 32 * 20] uint8 -> [N, K] float32 (d * q + m, the file's weights exactly) or bfloat16
    (those rounded to nearest even)."""
    assert dtype in (torch.float32, torch.bfloat16), f"Q4_1 dequantizes to float32 or bfloat16, not {dtype}"
    return load().q4_1_dequantize(packed, in_features, dtype == torch.bfloat16)


def q8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (int8 [M, K], float32 scales [M, K / 32]): the activation rounding q8_linear applies."""
    return load().q8_quantize(x)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as kernels.attention.reference.paged_decode_attention, float32 only."""
    return load().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    bf16: bool = False,
) -> torch.Tensor | None:
    """Same contract as kernels.attention.reference.paged_prefill_attention (int32 tables), or None where the
    kernel does not cover the case (neither AVX-512 nor AVX2, head_dim other than 64, non-float32): the caller then
    takes the reference. bf16: q.k and p.v as bfloat16 dot products summed in float32, where the CPU has them
    (float32 elsewhere)."""
    out = torch.empty(q.shape, dtype=q.dtype)
    done = load().paged_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, bf16
    )
    return out if done else None


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """kernels.attention.reference.store_kv for key, value and caches of one dtype, head_dim contiguous, int32 or
    int64 slots; anything else returns False without writing (the caller falls back to the reference)."""
    return load().store_kv(key, value, k_cache, v_cache, slot_mapping)
