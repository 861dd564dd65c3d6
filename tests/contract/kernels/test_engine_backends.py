"""The engine gives the same greedy tokens on the Triton (interpreted), C++ CPU and torch attention backends.

A tiny random Llama (head_dim 16, GQA 2) runs mixed batches of decodes and 16-token prefill chunks, and a prompt
that hits the prefix cache, so every kernel entry point is exercised the way the engine really calls it.
"""

import collections

import pytest
import torch

from tests.support.kernel_cases import DEVICE
from tests.support.tiny_llama import make_tiny_llama
from tokenweir.engine.llm import LLM
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.kernels.attention import triton_paged
from tokenweir.kernels.cpu import ops as cpu_ops


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def generate(model: str, backend: str) -> tuple[list[list[int]], int]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 40, 70)]
    later = prompts[3][:48] + [7, 8, 9]  # shares three full blocks with an earlier prompt
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(
        model,
        device=DEVICE.type,
        dtype="float32",
        quantization="none",
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        attention_backend=backend,
    )
    first = llm.generate(prompts, params)
    second = llm.generate([later], params)
    return [o.new_token_ids for o in first + second], second[0].num_cached_tokens


def test_triton_backend_matches_torch_in_the_engine(tiny_model, monkeypatch):
    calls = collections.Counter()
    for name in ("store_kv", "paged_decode_attention", "paged_prefill_attention"):
        fn = getattr(triton_paged, name)
        monkeypatch.setattr(
            triton_paged, name, lambda *a, _fn=fn, _name=name, **k: calls.update([_name]) or _fn(*a, **k)
        )

    want, want_cached = generate(tiny_model, "torch")
    assert not calls
    got, got_cached = generate(tiny_model, "triton")
    assert got == want
    assert got_cached == want_cached == 48
    assert all(calls[name] > 0 for name in ("store_kv", "paged_decode_attention", "paged_prefill_attention"))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the C++ kernels are the CPU engine's")
def test_cpu_backend_matches_torch_in_the_engine(tiny_model, monkeypatch):
    calls = collections.Counter()
    fn = cpu_ops.paged_decode_attention
    monkeypatch.setattr(cpu_ops, "paged_decode_attention", lambda *a, **k: calls.update(["decode"]) or fn(*a, **k))
    want, want_cached = generate(tiny_model, "torch")
    got, got_cached = generate(tiny_model, "cpu")
    assert got == want and got_cached == want_cached == 48
    assert calls["decode"] > 0
