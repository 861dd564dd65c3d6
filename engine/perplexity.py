"""Perplexity of a model on a token sequence, through the engine's own paged-attention forward.

The sequence is cut into independent windows (no context carried across), each run as one sequence in chunks, with
logits kept at every position. Returns the perplexity and each position's top-1 prediction, so two weight formats
can be compared on both: how well they predict the text, and how often they agree on the next token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata
from engine.model import LlamaForCausalLM


def _kv_pool(model: LlamaForCausalLM, tokens: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = model.config
    dtype = model.rope_cos.dtype
    shape = (-(-tokens // block_size), block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]


@torch.inference_mode()
def window_logprobs(
    model: LlamaForCausalLM, token_ids: list[int], chunk: int = 128, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """For one window: (log p(token[i+1] | token[:i+1]) for every i, top-1 prediction at every i)."""
    n = len(token_ids)
    kv = _kv_pool(model, n, block_size)
    block_table = torch.arange(len(kv[0][0]), dtype=torch.int32)[None, :]
    empty = torch.zeros((0, 1), dtype=torch.int32)
    targets = torch.tensor(token_ids[1:])
    logprobs, top1 = [], []
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)
        positions = torch.arange(start, end)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),  # block i holds positions [i*bs, (i+1)*bs): slot == position
            num_decode_tokens=0,
            decode_block_tables=empty,
            decode_context_lens=torch.zeros(0, dtype=torch.int32),
            prefill_block_tables=block_table,
            prefill_cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
            prefill_context_lens=torch.tensor([end], dtype=torch.int32),
            prefill_max_q=end - start,
        )
        inputs = torch.tensor(token_ids[start:end])
        logits = model.forward(inputs, positions, kv, meta, torch.arange(end - start))
        logp = F.log_softmax(logits, dim=-1)
        logprobs.append(logp.gather(1, targets[start:end, None])[:, 0])
        top1.append(logits.argmax(-1))
    return torch.cat(logprobs), torch.cat(top1)


def perplexity(model: LlamaForCausalLM, token_ids: list[int], window: int = 512) -> tuple[float, torch.Tensor]:
    """(perplexity over every predicted position, top-1 predictions in the same order)."""
    logprobs, top1 = [], []
    for start in range(0, len(token_ids) - 1, window):
        piece = token_ids[start : start + window]
        if len(piece) < 2:
            break
        lp, t1 = window_logprobs(model, piece)
        logprobs.append(lp)
        top1.append(t1)
    nll = -torch.cat(logprobs).double().mean().item()
    return math.exp(nll), torch.cat(top1)
