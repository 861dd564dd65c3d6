"""Engine fixtures, seen by every test folder (tests/conftest.py loads this module): a tiny random Llama (same
loader and model code path as the real one) and its HF twin. torch is imported inside the fixtures, so the gateway's
tests collect on the core install (no torch)."""

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.support.tiny_llama import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), seed=1)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer, read from the GGUF once for the session (the file's vocab takes seconds to parse)."""
    from tokenweir.common.text.model_files import default_model_path
    from tokenweir.common.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="session")
def smollm2_hf_float32():
    """HF transformers' SmolLM2 on the same GGUF weights, float32: the reference nobody here wrote. Loading it
    (gguf's numpy dequantizer) is slow, so one for the session; its users only run it."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenweir.common.text.model_files import default_model_path

    directory, file = default_model_path().rsplit("/", 1)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF transformers with no stop token: the reference nobody here wrote."""
    import torch

    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()
