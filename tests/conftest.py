"""Shared fixtures. Services (Redis, PostgreSQL) are real; under CI=true a missing one fails, never skips."""

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_service(name: str, reason: str) -> None:
    """Skip locally when a real service is down, but fail in CI where every service must be up."""
    if IN_CI:
        pytest.fail(f"{name} is required in CI: {reason}")
    pytest.skip(f"{name} unavailable: {reason}")


@pytest.fixture(scope="session")
def smollm2_float32_engine():
    """SmolLM2 in this process in the exact mode (float32, dense weights), 64 MiB of KV blocks, a 1024-token context.
    One for the session: building it (parsing and dequantizing the GGUF) costs more than most tests that use it. Its
    users read their own requests' outputs, deltas of its counters, or only its model and tokenizer."""
    from tokenweir.engine.config import EngineConfig
    from tokenweir.engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(kv_cache_memory=64 * 2**20, max_model_len=1024, dtype="float32", quantization="none"))
