"""Pick the attention backend. The engine calls get_ops(resolve_backend(...)).store_kv / paged_*_attention."""

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("triton", "cpu", "torch")
ENV_VAR = "TOKENWEIR_ATTENTION_BACKEND"


def resolve_backend(requested: str | None = None) -> str:
    """Explicit request > $TOKENWEIR_ATTENTION_BACKEND (triton|cpu|torch|auto) > auto: triton on CUDA, else the C++
    CPU kernels where they build on this machine, else the torch reference."""
    choice = (requested or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if choice == "auto":
        if torch.cuda.is_available():
            return "triton"
        from tokenweir.kernels.cpu import ops as cpu_ops

        return "cpu" if cpu_ops.load() is not None else "torch"
    if choice not in BACKENDS:
        raise ValueError(f"unknown attention backend {choice!r}: use one of triton, cpu, torch, auto")
    return choice


def get_ops(backend: str) -> ModuleType:
    """The module holding store_kv, paged_decode_attention and paged_prefill_attention for this backend."""
    assert backend in BACKENDS, f"backend must be one of {BACKENDS}, got {backend!r}"
    # Imported lazily so a CPU-only engine never pulls in triton (and TRITON_INTERPRET can be set first).
    return importlib.import_module(
        {"triton": "tokenweir.kernels.attention.triton_paged", "cpu": "tokenweir.kernels.attention.cpu_paged"}.get(
            backend, "tokenweir.kernels.attention.reference"
        )
    )
