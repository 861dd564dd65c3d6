"""Shared fixtures for every test group (unit, contract, app, process). Services (Redis, PostgreSQL) are real; under
CI=true a missing one fails, never skips (tests/support/services.py).

Kernel tests run the Triton kernels compiled on a GPU, or through Triton's interpreter on CPU (CI). TRITON_INTERPRET
must be in the environment before @triton.jit decorates the kernels, i.e. before kernels.attention.triton_paged is
first imported, so it is set here at collection, and only without CUDA: on a GPU machine the same tests check the
compiled kernels. If something imported the module earlier in compiled mode, it is reloaded.
"""

import importlib
import os
import sys

import pytest
import torch

pytest_plugins = ["tests.support.engine_fixtures", "tests.support.state"]

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "tokenweir.kernels.attention.triton_paged" in sys.modules:
        importlib.reload(sys.modules["tokenweir.kernels.attention.triton_paged"])


@pytest.fixture(scope="session")
def smollm2_float32_engine():
    """SmolLM2 in this process in the exact mode (float32, dense weights), 64 MiB of KV blocks, a 1024-token context.
    One for the session: building it (parsing and dequantizing the GGUF) costs more than most tests that use it. Its
    users read their own requests' outputs, deltas of its counters, or only its model and tokenizer."""
    from tokenweir.engine.config import EngineConfig
    from tokenweir.engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(kv_cache_memory=64 * 2**20, max_model_len=1024, dtype="float32", quantization="none"))
