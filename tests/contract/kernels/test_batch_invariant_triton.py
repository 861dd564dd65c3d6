"""The Triton batch-invariant matmul and RMSNorm (kernels/batch_invariant.py) against torch, and a row's output bit for
bit the same alone and in calls of any size. On CPU they run through Triton's interpreter in float32; on a GPU
(scripts/gpu_check.sh) compiled, in bfloat16 too, where cuBLAS's own GEMM does move rows with the batch.
Then the engine built with them: greedy tokens equal HF transformers' on a tiny Llama, alone and batched."""

import pytest
import torch

from tests.support.engine_fixtures import hf_greedy
from tests.support.kernel_cases import DEVICE
from tokenweir.engine.llm import LLM
from tokenweir.engine.model.llama import rms_norm as torch_rms_norm
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.kernels import batch_invariant

DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
BATCH_SIZES = [1, 2, 3, 5, 16, 63, 64, 65, 130]


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit on a GPU. The interpreter's tl.dot is numpy's BLAS, whose micro-kernels round a tile's rows
    differently by their place in it on some CPUs (an AVX2 EPYC: rows 6-11 of every 12), so there the check is
    to float32's last bits; the compiled kernel's invariance is checked where it runs, on CUDA."""
    if DEVICE.type == "cuda":
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-6, atol=1e-5)


# SmolLM2's qkv shape on a GPU (a smaller one through the interpreter, ~1/20 of its time), and sizes no tile divides
SHAPES = [(576, 960), (100, 70)] if DEVICE.type == "cuda" else [(160, 200), (100, 70)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_matmul_matches_torch_and_a_row_is_the_same_in_any_batch(dtype, k, n):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(max(BATCH_SIZES), k, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(k, n, generator=g) * k**-0.5).to(DEVICE, dtype)
    full = batch_invariant.matmul(x, weight)
    want = x.float() @ weight.float()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(full.float(), want, atol=tolerance, rtol=tolerance)
    alone = torch.cat([batch_invariant.matmul(x[i : i + 1], weight) for i in range(len(x))])
    assert same_rows(alone, full)
    for m in BATCH_SIZES:
        assert same_rows(batch_invariant.matmul(x[:m], weight), full[:m]), f"rows moved in a call of {m} rows"
    assert batch_invariant.matmul(x[:0], weight).shape == (0, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100])
def test_rms_norm_matches_torch_and_a_row_is_the_same_in_any_batch(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(max(BATCH_SIZES), hidden, generator=g) * 3).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    full = batch_invariant.rms_norm(x, weight, 1e-5)
    want = torch_rms_norm(x, weight, 1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(full.float(), want.float(), atol=tolerance, rtol=tolerance)
    for m in BATCH_SIZES:
        assert torch.equal(batch_invariant.rms_norm(x[:m], weight, 1e-5), full[:m])
    one = torch.cat([batch_invariant.rms_norm(x[i : i + 1], weight, 1e-5) for i in range(len(x))])
    assert torch.equal(one, full)


def test_the_engine_on_batch_invariant_kernels_gives_hf_transformers_greedy_tokens(tiny_model_dir, tiny_hf_model):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 17, 40)]
    want = [hf_greedy(tiny_hf_model, p, 6) for p in prompts]
    llm = LLM(
        tiny_model_dir,
        device=DEVICE.type,
        dtype="float32",
        quantization="none",
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        attention_backend="triton",
        batch_invariant=True,
    )
    assert llm.engine.runner.model.layers[0].norm is batch_invariant.rms_norm  # the kernels really run
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert [o.new_token_ids for o in llm.generate(prompts, params)] == want
    assert [llm.generate([p], params)[0].new_token_ids for p in prompts] == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"] if DEVICE.type == "cuda" else ["float32"])
def test_a_token_scores_the_same_decoded_as_recomputed_in_a_prompt(tiny_model_dir, dtype):
    """A decode row and the same position computed as part of a prompt (after preemption a sequence's tokens are
    recomputed so) give the same logprob: decode rows run through the prefill kernel in this mode."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 30, 70)]
    llm = LLM(
        tiny_model_dir,
        device=DEVICE.type,
        dtype=dtype,
        quantization="none",
        num_kv_blocks=64,
        max_num_batched_tokens=128,
        enable_prefix_caching=False,
        attention_backend="triton",
        batch_invariant=True,
    )
    decoded = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))
    again = [p + o.new_token_ids for p, o in zip(prompts, decoded, strict=True)]
    scored = llm.generate(again, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    for prompt, out, score in zip(prompts, decoded, scored, strict=True):
        assert out.logprobs is not None and score.prompt_logprobs is not None
        as_decoded = [lp.logprob for lp in out.logprobs]
        as_prompt = [lp.logprob for lp in score.prompt_logprobs[len(prompt) :] if lp is not None]
        assert len(as_prompt) == len(as_decoded) == 12
        if DEVICE.type == "cuda":
            assert as_prompt == as_decoded
        else:  # the interpreter's tl.dot is numpy's BLAS: see same_rows
            assert as_prompt == pytest.approx(as_decoded, abs=1e-5)
