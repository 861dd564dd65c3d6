"""Pick the attention backend. The engine calls get_ops(resolve_backend(...)).store_kv / paged_*_attention."""

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("triton", "torch")
ENV_VAR = "TOKENWEIR_ATTENTION_BACKEND"


def resolve_backend(requested: str | None = None) -> str:
    """Explicit request > $TOKENWEIR_ATTENTION_BACKEND (triton|torch|auto) > auto (triton iff CUDA)."""
    choice = (requested or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if choice == "auto":
        return "triton" if torch.cuda.is_available() else "torch"
    if choice not in BACKENDS:
        raise ValueError(f"unknown attention backend {choice!r}: use one of triton, torch, auto")
    return choice


def get_ops(backend: str) -> ModuleType:
    """The module holding store_kv, paged_decode_attention and paged_prefill_attention for this backend."""
    assert backend in BACKENDS, f"backend must be one of {BACKENDS}, got {backend!r}"
    # Imported lazily so a CPU-only engine never pulls in triton (and TRITON_INTERPRET can be set first).
    return importlib.import_module("kernels.triton_paged" if backend == "triton" else "kernels.reference")
