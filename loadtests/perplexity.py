"""Perplexity of a model on a token sequence, through the engine's own paged-attention forward.

The sequence is cut into independent windows (no context carried across), each run as one sequence in chunks, with
logits kept at every position. Returns the perplexity and each position's top-1 prediction, so two weight formats
can be compared on both: how well they predict the text, and how often they agree on the next token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tokenweir.engine.model.attention import AttentionMetadata
from tokenweir.engine.model.llama import LlamaForCausalLM


@torch.inference_mode()
def window_logprobs(
    model: LlamaForCausalLM, token_ids: list[int], chunk: int = 128, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """For one window: (log p(token[i+1] | token[:i+1]) for every i, top-1 prediction at every i)."""
    n = len(token_ids)
    kv = model.scratch_kv(n, block_size)
    targets = torch.tensor(token_ids[1:])
    logprobs, top1 = [], []
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)
        meta = AttentionMetadata.one_prefill(start, end, len(kv[0][0]))
        inputs = torch.tensor(token_ids[start:end])
        logits = model.forward(inputs, meta.slot_mapping, kv, meta, torch.arange(end - start))
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
