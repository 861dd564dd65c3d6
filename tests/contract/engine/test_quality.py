"""Faster formats keep the model's quality: on a fixed English text shipped with the tests (the GFDL 1.3, ~5k
tokens), each weight format's perplexity is within 3% of float32's and its greedy top-1 prediction agrees with
float32's at >= 95% of positions, int8 on both of its paths (prefill chunks on float32 activations, decode steps on
activations rounded to int8 too), and gguf (the file's own Q4_1 blocks, activations rounded to Q8_1, and its Q8_0
lm_head on activations rounded to int8: llama.cpp's numerics); gguf-a16, the same blocks with the activations in two
int8 planes, agrees at >= 99%, at >= 98% with its prefill chunks as bfloat16 GEMMs (what auto serves on a CPU with
native bf16), and at >= 95% with them through the int8 prefill kernel (llama.cpp's rounding, what auto serves where
that kernel beats float32: the AVX2 class). The float32 perplexity itself is checked against HF transformers' loss on
the same GGUF weights, so the yardstick is not ours alone."""

import math
import os

import pytest
import torch

from loadtests.perplexity import perplexity, window_logprobs
from tokenweir.common.text.model_files import default_model_path
from tokenweir.engine.model.linear import Int8Linear, Q4Linear
from tokenweir.engine.model.llama import LlamaForCausalLM
from tokenweir.engine.model.loader import load_gguf_blocks, load_model_weights
from tokenweir.engine.model.precision import has_native_bf16

pytestmark = pytest.mark.slow
CORPUS = os.path.join(os.path.dirname(__file__), "data", "gfdl-1.3.txt")
TOKENS = 2048


@pytest.fixture(scope="module")
def weights():
    return load_model_weights(default_model_path())


@pytest.fixture(scope="module")
def corpus(smollm2_tokenizer) -> list[int]:
    with open(CORPUS) as f:
        ids = smollm2_tokenizer.encode(f.read())
    assert len(ids) > TOKENS
    return ids[:TOKENS]


@pytest.fixture(scope="module")
def gguf_blocks():
    """The file's own blocks, read once: the models built on them repack them, never change them."""
    return load_gguf_blocks(default_model_path())


@pytest.fixture(scope="module")
def float32_result(weights, corpus):
    config, state = weights
    return perplexity(LlamaForCausalLM(config, state, torch.float32, "cpu", None, 2048, "none"), corpus)


def test_float32_log_likelihood_equals_hf_transformers_loss(weights, corpus, smollm2_hf_float32):
    config, state = weights
    window = corpus[:256]
    ours, _ = window_logprobs(LlamaForCausalLM(config, state, torch.float32, "cpu", None, 2048, "none"), window)
    hf = smollm2_hf_float32
    with torch.inference_mode():
        ids = torch.tensor([window])
        loss = hf(ids, labels=ids).loss.item()
    assert math.isclose(-ours.double().mean().item(), loss, rel_tol=1e-4)


@pytest.mark.parametrize(
    "dtype,quantization",
    [
        (torch.float32, "int8"),
        pytest.param(
            torch.bfloat16,
            "none",
            marks=pytest.mark.skipif(
                not has_native_bf16(), reason="no native bf16 on this CPU: emulated, 20-200x slow"
            ),
        ),
        pytest.param(
            torch.bfloat16,
            "int8",
            marks=pytest.mark.skipif(
                not has_native_bf16(), reason="no native bf16 on this CPU: emulated, 20-200x slow"
            ),
        ),
    ],
)
def test_format_stays_within_3_percent_of_float32_perplexity(weights, corpus, float32_result, dtype, quantization):
    config, state = weights
    model = LlamaForCausalLM(config, state, dtype, "cpu", None, 2048, quantization)
    assert_close_to_float32(model, corpus, float32_result, f"{dtype} {quantization}")


def test_w8a8_decode_kernel_stays_within_3_percent_of_float32_perplexity(weights, corpus, float32_result, monkeypatch):
    # The corpus runs as prefill chunks, wider than the rows the decode kernel takes: widened here, every position
    # goes through the kernel that decode steps use.
    monkeypatch.setattr(Int8Linear, "SMALL_M", 1 << 30)
    config, state = weights
    model = LlamaForCausalLM(config, state, torch.float32, "cpu", None, 2048, "w8a8")
    assert model.lm_head.int8_activations
    assert_close_to_float32(model, corpus, float32_result, "float32 int8, decode kernel (int8 activations)")


@pytest.mark.parametrize("mode,planes,bar", [("gguf", 1, 0.95), ("gguf-a16", 2, 0.99)])
def test_gguf_blocks_stay_within_3_percent_of_float32_perplexity(
    weights, corpus, float32_result, gguf_blocks, monkeypatch, mode, planes, bar
):
    # float32's weights are the file's blocks dequantized, so only the activations' rounding differs. The lm_head's
    # decode kernel is widened to every position, as in the w8a8 test; the Q4_1 kernel takes the 128-row chunks anyway.
    monkeypatch.setattr(Int8Linear, "SMALL_M", 1 << 30)
    assert Q4Linear.SMALL_M[planes, torch.float32] >= 128
    config, state = weights
    model = LlamaForCausalLM(config, state, torch.float32, "cpu", None, 2048, mode, gguf_blocks)
    assert isinstance(model.layers[0].gate_up_proj, Q4Linear) and model.layers[0].gate_up_proj.planes == planes
    assert model.lm_head.int8_activations and model.lm_head.planes == planes
    label = f"{mode}: Q4_1 x {planes} int8 plane(s), lm_head Q8_0 x {planes} int8 plane(s)"
    assert_close_to_float32(model, corpus, float32_result, label, bar)


@pytest.mark.skipif(not has_native_bf16(), reason="no native bf16 on this CPU: prefill chunks stay float32")
def test_gguf_a16_with_bfloat16_prefill_chunks_stays_within_3_percent_of_float32_perplexity(
    weights, corpus, float32_result, gguf_blocks, monkeypatch
):
    # What auto serves on a CPU with native bf16: decode rows on the two-plane kernel, prefill chunks (128 rows here,
    # over the kernel's 64) as bfloat16 GEMMs on the blocks dequantized for the call, and their attention with
    # bfloat16 dot products.
    monkeypatch.setattr(Int8Linear, "SMALL_M", 1 << 30)
    config, state = weights
    model = LlamaForCausalLM(config, state, torch.float32, "cpu", None, 2048, "gguf-a16", gguf_blocks, torch.bfloat16)
    assert model.layers[0].gate_up_proj.small_m < 128 and model.layers[0].attention.prefill_bf16
    assert_close_to_float32(model, corpus, float32_result, "gguf-a16, bfloat16 prefill chunks", 0.98)


def test_gguf_a16_with_int8_prefill_chunks_stays_within_3_percent_of_float32_perplexity(
    weights, corpus, float32_result, gguf_blocks, monkeypatch
):
    # What auto serves on a CPU without native bf16 where the int8 prefill kernel wins: decode rows on the two-plane
    # kernel, prefill chunks' activations rounded to Q8_1 (llama.cpp's numerics for a prompt). The 128-row chunks here
    # are taken to the prefill kernel; the lm_head's decode kernel is widened as above.
    monkeypatch.setattr(Int8Linear, "SMALL_M", 1 << 30)
    monkeypatch.setitem(Q4Linear.SMALL_M, (2, torch.int8), 64)
    config, state = weights
    model = LlamaForCausalLM(config, state, torch.float32, "cpu", None, 2048, "gguf-a16", gguf_blocks, torch.int8)
    assert model.layers[0].gate_up_proj.small_m < 128 and not model.layers[0].attention.prefill_bf16
    assert_close_to_float32(model, corpus, float32_result, "gguf-a16, int8 prefill chunks", 0.95)


def assert_close_to_float32(model, corpus, float32_result, label: str, agreement_bar: float = 0.95) -> None:
    base_ppl, base_top1 = float32_result
    ppl, top1 = perplexity(model, corpus)
    agreement = (top1 == base_top1).float().mean().item()
    print(f"{label}: perplexity {ppl:.3f} vs float32 {base_ppl:.3f}, top-1 agreement {agreement:.3f}")
    assert ppl <= base_ppl * 1.03
    assert agreement >= agreement_bar
