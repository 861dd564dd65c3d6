"""The unit tests that need an extra (the engine's torch, the tracing SDK, ruff) are left out where it is not
installed, so the gateway's, the policies' and common's unit tests run on the core install (`pip install tokenweir`
plus pytest and pytest-asyncio: the fast loop). Never under CI=true: there every extra is installed, and a missing
one must fail."""

import importlib.util
import os

NEEDS = {
    "torch": [
        "engine",
        "kernels",
        "common/test_chat_text.py",
        "gateway/test_cache_scope.py",
        "gateway/test_engine_replicas.py",
        "gateway/test_prefix_routing.py",
    ],
    "opentelemetry.sdk": ["common/test_tracing.py", "gateway/test_tracing.py"],
    "ruff": ["test_complexity.py"],
}


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing too
        return False


collect_ignore = [
    path
    for module, paths in NEEDS.items()
    if os.environ.get("CI", "") != "true" and not installed(module)
    for path in paths
]
