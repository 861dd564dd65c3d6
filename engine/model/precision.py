"""Which compute dtype and weight format run fastest on this machine, decided once at start.

`--dtype auto` on CPU: bfloat16 only where the CPU has native bf16 (avx512_bf16 / amx_bf16 in its flags) and a short
probe matmul at the model's own shape confirms it beats float32; without native bf16 a bf16 GEMM is emulated and
20-200x slower. `--quantization auto` on CPU: int8 weights where the int8 kernel for that dtype exists and its probe
beats the dense one at decode's shape (one row), except for a .gguf whose layers are stored as Q4_1: those run on
their own blocks with the activations in two int8 planes (`gguf-a16`: on SmolLM2 perplexity 21.538 vs float32's
21.539, greedy top-1 agreement 100%, and ~2.4x int8's batch-1 decode speed; `gguf`, one plane as llama.cpp, is ~10%
faster still but agrees on 96.1% of tokens, and answers "What is the capital of France?" as llama.cpp does, wrongly).
Their prefill chunks, compute-bound, are dense GEMMs on the blocks dequantized for the call: bfloat16 where the CPU has
native bf16 and a probe at a chunk's shape confirms it (2.5x float32 on an AVX-512 EPYC), and then their attention
takes bfloat16 dot products too (1.5x; with both, top-1 agreement 99.0%). Without native bf16 (the AVX2 class) they
run through the int8 prefill kernel where its probe beats float32 GEMM (~1.7x on an AVX2-only EPYC): the prompt's
activations rounded to Q8_1 as llama.cpp rounds them, while decode batches keep their two planes.
CUDA keeps bf16 and dense weights. Every decision is logged with the probe's numbers so a slow start is explainable.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from functools import cache

import torch

from tokenweir.engine.model.gguf_blocks import BLOCK_BYTES, QK, GGUFBlocks
from tokenweir.engine.model.linear import GGUF_MODES, Q4Linear, make_linear
from tokenweir.kernels.cpu import ops as cpu_ops

log = logging.getLogger("tokenweir.engine")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PROBE_SECONDS = 0.25


@dataclass(frozen=True, slots=True)
class Precision:
    dtype: torch.dtype
    quantization: str  # none | int8 | w8a8 | gguf | gguf-a16
    reason: str
    prefill_dtype: torch.dtype = torch.float32  # the gguf modes' dense GEMMs for prefill chunks


CPU_FLAGS_OFF_ENV = "TOKENWEIR_CPU_FLAGS_OFF"  # e.g. "avx512_bf16,amx_bf16": run as if the CPU lacked them


def cpu_flags() -> set[str]:
    """The CPU's flags (/proc/cpuinfo), less those named in TOKENWEIR_CPU_FLAGS_OFF (comma-separated) and those
    TOKENWEIR_CPU_ISA=avx2 takes away: the precision choices then follow the numerics of a CPU without them (e.g.
    float32 prefill chunks where bf16 would be picked)."""
    off = {f.strip() for f in os.environ.get(CPU_FLAGS_OFF_ENV, "").split(",") if f.strip()}
    isa_off = cpu_ops.ISA_FLAGS_OFF[cpu_ops.cpu_isa()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split()) - off
                    return {flag for flag in flags if not flag.startswith(isa_off)}
    except OSError:
        pass
    return set()


# CPU flags of 8-bit dot-product instructions: where the int8 weight kernel beats dense weights (what the probe finds)
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def has_native_bf16(flags: set[str] | None = None) -> bool:
    return bool((cpu_flags() if flags is None else flags) & {"avx512_bf16", "amx_bf16"})


def _ms_per_call(fn, budget_s: float = PROBE_SECONDS) -> float:
    fn()  # first call packs / warms caches
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget_s or calls < 3:
        fn()
        calls += 1
    return elapsed / calls * 1e3


def _probe_weights(shape: tuple[int, int]) -> list[torch.Tensor]:
    """Enough [out, in] weights to spill the caches (>= 64 MiB as float32): a decode step reads its weights from
    memory, so a probe on one cache-resident weight would flatter the format that reads more bytes."""
    count = max(2, -(-(64 * 2**20) // (shape[0] * shape[1] * 4)))
    return [torch.randn(shape[1], shape[0]) * 0.05 for _ in range(count)]


def _probe(dtype: torch.dtype, quantization: str, rows: int, weights: list[torch.Tensor]) -> float:
    linears = [make_linear(w.to(dtype), dtype, quantization) for w in weights]
    x = torch.randn(rows, weights[0].shape[1]).to(dtype)
    return _ms_per_call(lambda: [linear(x) for linear in linears]) / len(linears)


@cache
def resolve(
    dtype: str,
    quantization: str,
    device: torch.device,
    shape: tuple[int, int],
    gguf_kinds: frozenset[str] = frozenset(),
    batch_invariant: bool = False,
    shares_kv: bool = False,
) -> Precision:
    """shape: (in, out) of the model's widest per-layer projection, the one that dominates a step; gguf_kinds: the
    storage types of a .gguf model's layer matrices (empty otherwise); batch_invariant: on CPU `auto` stays float32,
    the dtype of the C++ kernels whose rows never depend on their batch; shares_kv: the engine exchanges KV with
    others (disaggregated prefill), so `auto` is decided by the CPU's flags, never by a timing probe: two engines
    started side by side on a busy machine could time it differently, and a consumer refuses a producer whose KV
    layout (dtype, weights) differs from its own. Cached: a process that builds several engines probes once."""
    if device.type != "cpu":
        resolved = torch.bfloat16 if dtype == "auto" else DTYPES[dtype]
        assert quantization in ("none", "auto"), "int8 and gguf weights are CPU kernels: --quantization none on CUDA"
        return Precision(resolved, "none", f"{device.type}: {resolved}, dense weights")
    prefill_dtype = torch.float32
    own_blocks = quantization == "auto" and gguf_kinds == {"Q4_1"} and cpu_ops.load() is not None
    if dtype == "auto":
        gguf = own_blocks or quantization in GGUF_MODES
        resolved, note = _auto_dtype(shape, gguf, batch_invariant, shares_kv)
    else:
        resolved, note = DTYPES[dtype], f"{DTYPES[dtype]} (asked)"
    notes = [note]
    quant = quantization
    if quantization == "auto":
        quant, note = _auto_quantization(resolved, shape, own_blocks, shares_kv)
        notes.append(note)
    elif quantization in ("int8", "w8a8", "gguf", "gguf-a16"):
        assert resolved in (torch.float32, torch.bfloat16), f"{quantization} needs float32 or bfloat16, not {resolved}"
        notes.append(f"{quantization} (asked)")
    if quant in GGUF_MODES:
        prefill_dtype, note = _prefill_dtype(shape)
        notes.append(note)
    return Precision(resolved, quant, "; ".join(notes), prefill_dtype)


def _auto_dtype(shape: tuple[int, int], gguf: bool, batch_invariant: bool, shares_kv: bool) -> tuple[torch.dtype, str]:
    """`--dtype auto` on CPU, and why."""
    if gguf:  # their kernels and the C++ attention compute in float32: bf16 would only add conversions
        return torch.float32, "float32 (the GGUF's own blocks)"
    if not has_native_bf16():
        return torch.float32, "float32 (no native bf16 in the CPU flags)"
    if batch_invariant:
        return torch.float32, "float32 (batch invariant: the CPU kernels that give it are float32)"
    if shares_kv:
        return (
            torch.bfloat16,
            "bfloat16 (native bf16 in the CPU flags; an engine that shares KV decides without a probe)",
        )
    weights = _probe_weights(shape)
    f32, bf16 = _probe(torch.float32, "none", 16, weights), _probe(torch.bfloat16, "none", 16, weights)
    resolved = torch.bfloat16 if bf16 * 1.2 < f32 else torch.float32
    return resolved, f"{resolved} (probe 16x{shape[0]}x{shape[1]}: bf16 {bf16:.3f} ms, f32 {f32:.3f} ms)"


def _auto_quantization(
    resolved: torch.dtype, shape: tuple[int, int], own_blocks: bool, shares_kv: bool
) -> tuple[str, str]:
    """`--quantization auto` on CPU for weights in `resolved`, and why."""
    if resolved not in (torch.float32, torch.bfloat16):
        return "none", f"dense weights (no int8 kernel for {resolved})"
    if cpu_ops.load() is None:
        return "none", "dense weights (the int8 kernel could not be built here)"
    if own_blocks:
        return "gguf-a16", "gguf-a16: the file's own Q4_1 blocks, activations in two int8 planes"
    if shares_kv:
        quant = "int8" if cpu_flags() & INT8_DOT_FLAGS else "none"
        return quant, f"{quant} weights (by the CPU's 8-bit dot-product flags; no probe: the engine shares KV)"
    weights = _probe_weights(shape)
    dense, int8 = _probe(resolved, "none", 1, weights), _probe(resolved, "int8", 1, weights)
    quant = "int8" if int8 * 1.1 < dense else "none"
    return quant, f"{quant} weights (probe 1x{shape[0]}x{shape[1]}: int8 {int8:.3f} ms, dense {dense:.3f} ms)"


def _prefill_dtype(shape: tuple[int, int]) -> tuple[torch.dtype, str]:
    """How prefill chunks of the GGUF's own blocks multiply, compute-bound: bfloat16 GEMMs where the CPU has native
    bf16 and a probe at a chunk's shape (256 rows, weights hot) confirms it; else the int8 prefill kernel where its
    probe beats float32 GEMM (the AVX2 class: 8-bit products at twice the FMA rate; llama.cpp's numerics for prompts,
    decode batches keep theirs)."""
    if not has_native_bf16():
        return _int8_or_float32_prefill(shape)
    weights = [torch.randn(shape[1], shape[0]) * 0.05]
    f32, bf16 = _probe(torch.float32, "none", 256, weights), _probe(torch.bfloat16, "none", 256, weights)
    chosen = torch.bfloat16 if bf16 * 1.2 < f32 else torch.float32
    return chosen, f"prefill chunks in {chosen} (probe 256x{shape[0]}x{shape[1]}: bf16 {bf16:.3f} ms, f32 {f32:.3f} ms)"


def _int8_or_float32_prefill(shape: tuple[int, int]) -> tuple[torch.dtype, str]:
    rows, blocks = shape[1], shape[0] // QK
    raw = torch.randint(0, 256, (rows, blocks, BLOCK_BYTES["Q4_1"]), dtype=torch.uint8)
    raw[..., 0:4] = torch.tensor([0.01, 0.01], dtype=torch.float16).view(torch.uint8)  # d and m of every block
    layer = Q4Linear(GGUFBlocks("Q4_1", raw.reshape(rows, -1)), planes=2)  # float32 prefill: dequantize + GEMM
    x = torch.randn(256, shape[0])
    f32 = _ms_per_call(lambda: layer(x))
    int8 = _ms_per_call(lambda: cpu_ops.q4_1_prefill(x, layer.packed))
    chosen = torch.int8 if int8 * 1.2 < f32 else torch.float32
    name = "int8 (activations rounded to Q8_1)" if chosen == torch.int8 else "float32"
    return chosen, f"prefill chunks in {name} (probe 256x{shape[0]}x{shape[1]}: int8 {int8:.3f} ms, f32 {f32:.3f} ms)"
