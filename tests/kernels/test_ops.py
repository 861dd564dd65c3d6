"""Backend selection: explicit request > $TOKENWEIR_ATTENTION_BACKEND > auto (triton only with CUDA)."""

import pytest
import torch

from kernels import ops, reference, triton_paged


def test_explicit_request_wins_over_env(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    assert ops.resolve_backend("torch") == "torch"
    assert ops.resolve_backend("TRITON") == "triton"


def test_env_then_auto(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    assert ops.resolve_backend() == "torch"
    monkeypatch.setenv(ops.ENV_VAR, "auto")
    assert ops.resolve_backend() == ("triton" if torch.cuda.is_available() else "torch")
    monkeypatch.delenv(ops.ENV_VAR)
    assert ops.resolve_backend(None) == ("triton" if torch.cuda.is_available() else "torch")


def test_unknown_backend_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        ops.resolve_backend("cuda")
    monkeypatch.setenv(ops.ENV_VAR, "flash")
    with pytest.raises(ValueError, match="flash"):
        ops.resolve_backend()


def test_get_ops_returns_the_backend_module():
    assert ops.get_ops("torch") is reference
    assert ops.get_ops("triton") is triton_paged
    for module in (reference, triton_paged):
        for name in ("store_kv", "paged_decode_attention", "paged_prefill_attention"):
            assert callable(getattr(module, name))
