"""Choosing the compute format: `auto` never picks emulated bf16, explicit choices are kept, and every format the
engine can build (float32 dense or int8, bf16 dense or int8) runs the tiny model to logits close to HF's float32."""

import json
import os
import subprocess
import sys

import pytest
import torch

from loadtests.perplexity import window_logprobs
from tokenweir.common.text.model_files import default_model_path
from tokenweir.engine.llm import LLM
from tokenweir.engine.model import precision
from tokenweir.engine.model.llama import LlamaForCausalLM
from tokenweir.engine.model.loader import load_model_weights
from tokenweir.engine.model.precision import cpu_flags, has_native_bf16, resolve
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.kernels.cpu import ops as cpu_ops

SHAPE = (576, 3072)


def test_auto_picks_float32_on_a_cpu_without_native_bf16_and_says_why():
    choice = resolve("auto", "none", torch.device("cpu"), SHAPE)
    if not has_native_bf16(cpu_flags()):
        assert choice.dtype == torch.float32 and "no native bf16" in choice.reason
    else:
        assert choice.dtype in (torch.float32, torch.bfloat16) and "probe" in choice.reason


def test_auto_quantization_reports_the_probe_it_decided_on():
    choice = resolve("float32", "auto", torch.device("cpu"), SHAPE)
    assert choice.quantization in ("none", "int8")
    assert "probe 1x576x3072" in choice.reason and "int8" in choice.reason


def test_an_engine_that_shares_kv_decides_auto_by_the_cpu_flags_alone(monkeypatch):
    """Two engines of a disaggregated pool must agree on their KV layout: no timing probe, which a busy machine can
    tip either way, decides it (a probe here fails the test)."""

    def no_probe(*args, **kwargs):
        raise AssertionError("an engine that shares KV ran a timing probe")

    monkeypatch.setattr(precision, "_probe", no_probe)
    resolve.cache_clear()
    try:
        choice = resolve("auto", "auto", torch.device("cpu"), SHAPE, shares_kv=True)
    finally:
        resolve.cache_clear()
    assert choice.dtype == (torch.bfloat16 if has_native_bf16(cpu_flags()) else torch.float32), choice.reason
    if cpu_ops.load() is not None:
        assert choice.quantization == ("int8" if cpu_flags() & precision.INT8_DOT_FLAGS else "none"), choice.reason
        assert "(probe" not in choice.reason  # a probe's note: "(probe 16x576x3072: bf16 ... ms, f32 ... ms)"


def test_auto_runs_a_q4_1_gguf_on_its_own_blocks_and_others_on_the_probe():
    if cpu_ops.load() is None:
        pytest.skip("no C++ compiler: auto keeps dense weights")
    choice = resolve("float32", "auto", torch.device("cpu"), SHAPE, frozenset({"Q4_1"}))
    assert choice.quantization == "gguf-a16" and "Q4_1" in choice.reason
    # prefill chunks are compute-bound: bfloat16 GEMMs only where the CPU has native bf16, else the int8 prefill
    # kernel or float32 GEMMs, whichever its probe finds faster; said with the probe
    assert "prefill chunks in" in choice.reason and "probe 256x576x3072" in choice.reason
    if has_native_bf16():
        assert choice.prefill_dtype in (torch.bfloat16, torch.float32)
    else:
        assert choice.prefill_dtype in (torch.int8, torch.float32) and "int8 " in choice.reason
    # its kernels compute in float32, so auto never adds bf16 conversions around them, native bf16 or not
    assert resolve("auto", "auto", torch.device("cpu"), SHAPE, frozenset({"Q4_1"})).dtype == torch.float32
    for asked in ("gguf", "gguf-a16"):  # asked for by name, the same
        assert resolve("auto", asked, torch.device("cpu"), SHAPE, frozenset({"Q4_1"})).dtype == torch.float32
    for kinds in (frozenset({"F16"}), frozenset({"Q4_1", "Q6_K"}), frozenset()):
        assert resolve("float32", "auto", torch.device("cpu"), SHAPE, kinds).quantization in ("none", "int8")


def test_the_default_model_is_a_q4_1_gguf_so_auto_serves_it_on_its_blocks(tiny_model_dir):
    assert load_model_weights(default_model_path())[0].layer_formats == {"Q4_1"}
    assert load_model_weights(tiny_model_dir)[0].layer_formats == frozenset()  # a HF directory


def test_explicit_choices_are_kept():
    assert resolve("float32", "none", torch.device("cpu"), SHAPE).quantization == "none"
    assert resolve("float32", "int8", torch.device("cpu"), SHAPE).quantization == "int8"
    assert resolve("float32", "w8a8", torch.device("cpu"), SHAPE).quantization == "w8a8"
    assert resolve("bfloat16", "none", torch.device("cpu"), SHAPE).dtype == torch.bfloat16


def test_every_format_gives_logits_close_to_hf_float32(tiny_model_dir, tiny_hf_model):
    config, state = load_model_weights(tiny_model_dir)
    prompt = list(range(3, 60))
    with torch.inference_mode():
        ref = torch.log_softmax(tiny_hf_model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    expected = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    for dtype, quantization, tolerance in [
        (torch.float32, "none", 1e-5),
        (torch.float32, "int8", 0.02),
        (torch.bfloat16, "none", 0.02),
        (torch.bfloat16, "int8", 0.03),
    ]:
        model = LlamaForCausalLM(config, state, dtype, "cpu", None, 1024, quantization)
        ours, _ = window_logprobs(model, prompt, chunk=16)
        relative_error = ((ours - expected).abs().mean() / expected.abs().mean()).item()  # the random model is sharp
        assert relative_error < tolerance, (dtype, quantization, relative_error)


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_an_int8_engine_serves_requests_end_to_end(tiny_model_dir, quantization):
    llm = LLM(tiny_model_dir, quantization=quantization, num_kv_blocks=32, max_num_batched_tokens=16)
    assert llm.engine.precision.quantization == quantization
    assert llm.engine.model.lm_head.int8_activations == (quantization == "w8a8")
    outs = llm.generate([list(range(3, 40)), [5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.num_output_tokens for o in outs] == [8, 8]
    assert llm.engine.block_manager.num_free_blocks == 32  # every block back (cached prefixes stay evictable)


def test_the_avx2_switch_builds_for_x86_64_v3_and_hides_the_wider_flags():
    """TOKENWEIR_CPU_ISA=avx2 (kernels/cpu/ops.py), in a fresh interpreter as an engine would start under it."""
    code = (
        "import os, json\n"
        "from tokenweir.kernels.cpu import ops\n"
        "from tokenweir.engine.model.precision import cpu_flags\n"
        "ops.hold_torch_to_isa()\n"
        "print(json.dumps({'cflags': ops.CFLAGS, 'flags': sorted(cpu_flags()),\n"
        "                  'torch': {k: os.environ.get(k) for k in ops.TORCH_ISA_ENV}}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in cpu_ops.TORCH_ISA_ENV}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env, "TOKENWEIR_CPU_ISA": "avx2"}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert "-march=x86-64-v3" in seen["cflags"] and "-march=native" not in seen["cflags"]
    assert not [f for f in seen["flags"] if f.startswith(("avx512", "amx", "avx_vnni"))]
    assert ("avx2" in seen["flags"]) == ("avx2" in cpu_flags())  # what the class has stays
    assert seen["torch"] == cpu_ops.TORCH_ISA_ENV
    bad = subprocess.run(
        [sys.executable, "-c", code], env={**env, "TOKENWEIR_CPU_ISA": "avx3"}, capture_output=True, text=True
    )
    assert bad.returncode != 0 and "TOKENWEIR_CPU_ISA: one of native, avx2, got 'avx3'" in bad.stderr
