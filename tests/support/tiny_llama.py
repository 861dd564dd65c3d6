"""A tiny random-weight Llama written as a HF directory, so fast tests run the same loading and model code path."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def make_tiny_llama(
    path: str,
    *,
    seed: int = 0,
    vocab_size: int = 256,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
) -> str:
    """Write config.json + model.safetensors with random weights in HF's Llama naming; returns `path`."""
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden_size // num_heads

    def rand(*shape: int, scale: float = 0.25) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    state = {
        "model.embed_tokens.weight": rand(vocab_size, hidden_size, scale=1.0),
        "model.norm.weight": 1 + rand(hidden_size),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": 1 + rand(hidden_size),
            p + "post_attention_layernorm.weight": 1 + rand(hidden_size),
            p + "self_attn.q_proj.weight": rand(num_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": rand(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.v_proj.weight": rand(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.o_proj.weight": rand(hidden_size, num_heads * head_dim),
            p + "mlp.gate_proj.weight": rand(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": rand(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": rand(hidden_size, intermediate_size),
        }
    if not tie_word_embeddings:
        state["lm_head.weight"] = rand(vocab_size, hidden_size, scale=0.5)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def add_byte_tokenizer(path: str) -> str:
    """Give a tiny model (vocab_size >= 258) a tokenizer, so that chat requests run on it: byte-level BPE without
    merges (token i is byte i, in GPT-2's byte-to-unicode spelling), <s> and </s> at 256 and 257, and a chat
    template that joins the messages' contents."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    added = [{"id": 256 + i, "content": tok, "special": True} for i, tok in enumerate(("<s>", "</s>"))]
    tokenizer = {
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
        "added_tokens": added,
        "pre_tokenizer": {"type": "ByteLevel"},
    }
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
    }
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (its encoder.py): printable bytes stand for themselves, the others
    for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table
