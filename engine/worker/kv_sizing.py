"""How many KV blocks the pool gets: the bytes of one block, and on a GPU the share of device memory left after the
weights and the activations' peak, measured by a warm-up forward (as nano-vllm does). On CPU the pool is the fixed
--kv-cache-memory budget. ModelRunner calls `num_kv_blocks` once its model is on the device."""

from __future__ import annotations

import logging

import torch

from tokenweir.engine.config import EngineConfig, ModelConfig
from tokenweir.engine.model.attention import AttentionMetadata
from tokenweir.engine.model.llama import LlamaForCausalLM

log = logging.getLogger("tokenweir.engine")


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def kv_budget_bytes(total: int, free: int, utilization: float, own_bytes: int, activation_peak: int) -> int:
    """Bytes for this process's KV pool on a GPU: its share (`utilization` of the device's memory, per instance as
    vLLM reads gpu_memory_utilization, so two engines on one GPU take about half each) less what it holds already
    (`own_bytes`, the weights) and the activations' peak; never more than is free now, less that peak."""
    share = int(utilization * total) - own_bytes - activation_peak
    return max(min(share, free - activation_peak), 0)


def num_kv_blocks(model: LlamaForCausalLM, config: EngineConfig, block_bytes: int, device: torch.device) -> int:
    """The pool's size in blocks: --num-kv-blocks when given, else what the memory budget holds."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if device.type != "cuda":
        return config.kv_cache_memory // block_bytes
    # The weights are on the device already; a warm-up forward of the largest step measures the activations' peak,
    # and the pool gets what is left of this process's share after both.
    activation_peak = warmup_peak_bytes(model, config, device)
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(
        total, free, config.gpu_memory_utilization, torch.cuda.memory_reserved(device), activation_peak
    )
    return max(budget // block_bytes, 0)


def warmup_peak_bytes(model: LlamaForCausalLM, config: EngineConfig, device: torch.device) -> int:
    """Peak bytes allocated above the weights by one prefill of max_num_batched_tokens (a throwaway KV pool)."""
    tokens = min(config.max_num_batched_tokens, model.config.max_position_embeddings)
    kv = model.scratch_kv(tokens, config.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    meta = AttentionMetadata.one_prefill(0, tokens, len(kv[0][0]), device)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    model.forward(ids, meta.slot_mapping, kv, meta, torch.tensor([tokens - 1], device=device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del kv, meta
    torch.cuda.empty_cache()
    log.info("warm-up: %d tokens, activation peak %.0f MiB", tokens, peak / 2**20)
    return peak
