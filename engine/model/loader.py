"""Load Llama-family weights from a GGUF file (dequantized) or a HF directory (config.json + safetensors).

Both paths produce one canonical state dict in torch's [out, in] layout with HF's rotate-half RoPE convention, so the
model code does not care where the weights came from. `load_gguf_blocks` also keeps a GGUF's quantized matrices as
the file stores them, under the same names, for `--quantization gguf`.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenweir.common.text.gguf_file import GGUFTensorInfo, read_gguf
from tokenweir.engine.config import ModelConfig
from tokenweir.engine.model.gguf_blocks import BLOCK_BYTES, GGUFBlocks

# llama.cpp's converter permutes q/k rows of these architectures for its interleaved RoPE; we undo it.
PERMUTED_QK_ARCHS = {"llama", "mistral"}

GGUF_NAMES = {
    "attn_norm.weight": "input_norm",
    "attn_q.weight": "q_proj.weight",
    "attn_k.weight": "k_proj.weight",
    "attn_v.weight": "v_proj.weight",
    "attn_q.bias": "q_proj.bias",
    "attn_k.bias": "k_proj.bias",
    "attn_v.bias": "v_proj.bias",
    "attn_output.weight": "o_proj",
    "ffn_norm.weight": "post_attention_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
}

HF_NAMES = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q_proj.weight",
    "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight",
    "self_attn.q_proj.bias": "q_proj.bias",
    "self_attn.k_proj.bias": "k_proj.bias",
    "self_attn.v_proj.bias": "v_proj.bias",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_attention_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}


def load_model_weights(path: str, progress: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Return (config, canonical float32 state dict) for a .gguf file or a HF model directory."""
    if os.path.isdir(path):
        return _load_hf_dir(path)
    if path.endswith(".gguf"):
        return _load_gguf(path, progress)
    raise ValueError(f"unsupported model path {path!r}: expected a .gguf file or a HF model directory")


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's `permute`: interleaved RoPE pairs back to HF's rotate-half halves."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True, slots=True)
class _Tensor:
    """A tensor of a .gguf file as gguf.GGUFReader gives it: `shape` in ggml's order (fastest first), `data` a
    read-only view of the file, typed for float and integer tensors, bytes [rows, bytes per row] for block formats."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
           "I32": np.int32, "I64": np.int64}  # fmt: skip


class MappedGGUF:
    """A .gguf file's fields and tensors (common/text/gguf_file.py reads the directory; the data is mapped)."""

    def __init__(self, path: str) -> None:
        file = read_gguf(path)
        self.fields = file.fields
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        self.tensors = [self._tensor(path, raw, info) for info in file.tensors]

    @staticmethod
    def _tensor(path: str, raw: np.ndarray, info: GGUFTensorInfo) -> _Tensor:
        kind = GGMLQuantizationType(info.ggml_type)
        block, type_size = GGML_QUANT_SIZES[kind]
        dims = tuple(reversed(info.dims))  # numpy's order
        end = info.offset + math.prod(dims) * type_size // block
        if end > raw.size:
            raise ValueError(f"{path}: tensor {info.name} runs past the end of the file (cut short?)")
        data = raw[info.offset : end]
        dtype = _DTYPES.get(kind.name)
        if dtype is not None:
            data = data.view(dtype).reshape(dims)
        else:
            data = data.reshape(*dims[:-1], dims[-1] // block * type_size)
        return _Tensor(info.name, kind, info.dims, data)


def _gguf_field(reader: MappedGGUF, key: str, default=None):
    return reader.fields.get(key, default)


def _load_gguf(path: str, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf.quants import dequantize

    reader = MappedGGUF(path)
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"{path}: architecture {arch!r} is not a supported Llama-family decoder")
    num_heads = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    hidden = int(_gguf_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    config = ModelConfig(
        vocab_size=int(_gguf_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0)),
        hidden_size=hidden,
        intermediate_size=int(_gguf_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_gguf_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(_gguf_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_gguf_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        name=os.path.basename(path).removesuffix(".gguf"),
        layer_formats=frozenset(
            t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2
        ),
    )
    state: dict[str, torch.Tensor] = {}
    start = time.monotonic()
    for i, tensor in enumerate(reader.tensors):
        array = dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists dims fastest-first
        weight = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)
        name = _canonical_gguf_name(tensor.name)
        if arch in PERMUTED_QK_ARCHS and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_qk(weight, num_heads)
        elif arch in PERMUTED_QK_ARCHS and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_qk(weight, num_kv_heads)
        state[name] = weight
        if progress and (i + 1) % 16 == 0 or progress and i + 1 == len(reader.tensors):
            print(
                f"\rloading {os.path.basename(path)}: {i + 1}/{len(reader.tensors)} tensors "
                f"({time.monotonic() - start:.1f}s)",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if progress:
        print(file=sys.stderr)
    return config, state


def load_gguf_blocks(path: str) -> dict[str, GGUFBlocks]:
    """The matrices of a .gguf file stored in a block format a kernel takes (Q4_1, Q8_0), undequantized: canonical
    name -> GGUFBlocks with rows in torch's [out, in] order (q/k rows unpermuted as `load_model_weights` does)."""
    if not path.endswith(".gguf"):
        raise ValueError(f"{path}: --quantization gguf takes a .gguf model; a HF directory has no GGUF blocks")
    reader = MappedGGUF(path)
    arch = _gguf_field(reader, "general.architecture")
    num_heads = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    blocks: dict[str, GGUFBlocks] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in BLOCK_BYTES or len(tensor.shape) != 2:
            continue
        data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).reshape(int(tensor.shape[1]), -1)
        name = _canonical_gguf_name(tensor.name)
        if arch in PERMUTED_QK_ARCHS and name.endswith("q_proj.weight"):
            data = unpermute_qk(data, num_heads)  # whole rows move: the blocks inside a row stay as they are
        elif arch in PERMUTED_QK_ARCHS and name.endswith("k_proj.weight"):
            data = unpermute_qk(data, num_kv_heads)
        blocks[name] = GGUFBlocks(kind, data.contiguous())
    return blocks


def _canonical_gguf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "embed_tokens"
    if name == "output_norm.weight":
        return "norm"
    if name == "output.weight":
        return "lm_head"
    assert name.startswith("blk."), f"unexpected GGUF tensor {name}"
    _, layer, rest = name.split(".", 2)
    assert rest in GGUF_NAMES, f"unexpected GGUF tensor {name}"
    return f"layers.{layer}.{GGUF_NAMES[rest]}"


def _load_hf_dir(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    config = ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads", num_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=os.path.basename(os.path.normpath(path)),
    )
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file).items():
            state[_canonical_hf_name(name)] = tensor.float()
    if config.tie_word_embeddings:
        state.pop("lm_head", None)
    return config, state


def _canonical_hf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "embed_tokens"
    if name == "model.norm.weight":
        return "norm"
    if name == "lm_head.weight":
        return "lm_head"
    prefix, layer, rest = name.split(".", 3)[0:1] + name.split(".", 3)[2:3] + name.split(".", 3)[3:]
    assert prefix == "model" and rest in HF_NAMES, f"unexpected HF tensor {name}"
    return f"layers.{layer}.{HF_NAMES[rest]}"
