"""Shared fixtures for every test group (unit, contract, app, process). Services (Redis, PostgreSQL) are real; under
CI=true a missing one fails, never skips (tests/support/services.py).

Kernel tests run the Triton kernels compiled on a GPU, or through Triton's interpreter on CPU (CI). TRITON_INTERPRET
must be in the environment before @triton.jit decorates the kernels, i.e. before kernels.attention.triton_paged is
first imported, so it is set here at collection, and only without CUDA: on a GPU machine the same tests check the
compiled kernels. If something imported the module earlier in compiled mode, it is reloaded.

This file imports no torch (whether CUDA is there is read from torch's build record and the driver's device files),
so `pytest tests/unit -m "not slow"` starts in a second and runs on the core install.
"""

import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

pytest_plugins = ["tests.support.engine_fixtures", "tests.support.state"]


def cuda_usable() -> bool:
    """torch.cuda.is_available() without importing torch: a CUDA build of torch, an NVIDIA driver, and devices not
    hidden by CUDA_VISIBLE_DEVICES."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    version = Path(spec.origin).with_name("version.py")
    built_for_cuda = version.is_file() and re.search(r"^cuda\b.*=\s*['\"]", version.read_text(), re.M) is not None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return built_for_cuda and Path("/dev/nvidiactl").exists() and visible not in ("", "-1")


def share_the_cores_between_workers() -> None:
    """Under pytest-xdist, each worker's OpenMP (torch and the CPU kernels) gets its share of the cores, not all of
    them. Measured on 2 cores with 3 workers: the speculative-decoding and quality tests took over 600 s at 2 threads
    each (OpenMP threads spin-waiting for cores another worker holds) and 181 s at 1. Set before anything imports
    torch (this file imports none); a value in the environment wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 0:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


share_the_cores_between_workers()

UNIT_TESTS = Path(__file__).parent / "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests under tests/unit `unit`, so scripts/check.sh can run the fast loop first (`unit and not slow`)
    and then everything else (`not unit or slow`) without naming a test twice."""
    for item in items:
        if item.path.is_relative_to(UNIT_TESTS):
            item.add_marker(pytest.mark.unit)


if not cuda_usable():
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
