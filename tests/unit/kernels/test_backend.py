"""Backend selection: explicit request > $TOKENWEIR_ATTENTION_BACKEND > auto (triton with CUDA, else the C++ CPU
kernels where they build, else torch)."""

import pytest
import torch

from tokenweir.kernels.attention import backend, cpu_paged, reference, triton_paged
from tokenweir.kernels.cpu import ops as cpu_ops

AUTO = "triton" if torch.cuda.is_available() else ("cpu" if cpu_ops.load() is not None else "torch")


def test_explicit_request_wins_over_env(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    assert backend.resolve_backend("torch") == "torch"
    assert backend.resolve_backend("TRITON") == "triton"


def test_env_then_auto(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    assert backend.resolve_backend() == "torch"
    monkeypatch.setenv(backend.ENV_VAR, "auto")
    assert backend.resolve_backend() == AUTO
    monkeypatch.delenv(backend.ENV_VAR)
    assert backend.resolve_backend(None) == AUTO
    assert backend.resolve_backend("cpu") == "cpu"


def test_unknown_backend_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        backend.resolve_backend("cuda")
    monkeypatch.setenv(backend.ENV_VAR, "flash")
    with pytest.raises(ValueError, match="flash"):
        backend.resolve_backend()


def test_get_ops_returns_the_backend_module():
    assert backend.get_ops("torch") is reference
    assert backend.get_ops("triton") is triton_paged
    assert backend.get_ops("cpu") is cpu_paged
    for module in (reference, triton_paged, cpu_paged):
        for name in ("store_kv", "paged_decode_attention", "paged_prefill_attention"):
            assert callable(getattr(module, name))
