"""Backend selection: explicit request > $TOKENWEIR_ATTENTION_BACKEND > auto (triton with CUDA, else the C++ CPU
kernels where they build, else torch)."""

import pytest
import torch

from tokenweir.kernels import cpu_ops, cpu_paged, ops, reference, triton_paged

AUTO = "triton" if torch.cuda.is_available() else ("cpu" if cpu_ops.load() is not None else "torch")


def test_explicit_request_wins_over_env(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    assert ops.resolve_backend("torch") == "torch"
    assert ops.resolve_backend("TRITON") == "triton"


def test_env_then_auto(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    assert ops.resolve_backend() == "torch"
    monkeypatch.setenv(ops.ENV_VAR, "auto")
    assert ops.resolve_backend() == AUTO
    monkeypatch.delenv(ops.ENV_VAR)
    assert ops.resolve_backend(None) == AUTO
    assert ops.resolve_backend("cpu") == "cpu"


def test_unknown_backend_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        ops.resolve_backend("cuda")
    monkeypatch.setenv(ops.ENV_VAR, "flash")
    with pytest.raises(ValueError, match="flash"):
        ops.resolve_backend()


def test_get_ops_returns_the_backend_module():
    assert ops.get_ops("torch") is reference
    assert ops.get_ops("triton") is triton_paged
    assert ops.get_ops("cpu") is cpu_paged
    for module in (reference, triton_paged, cpu_paged):
        for name in ("store_kv", "paged_decode_attention", "paged_prefill_attention"):
            assert callable(getattr(module, name))
