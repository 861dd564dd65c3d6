"""Torch paged attention and KV-cache write: the CPU engine's hot path and the Triton kernels' oracle.

Cache layout per layer: k_cache / v_cache are [num_blocks, block_size, num_kv_heads, head_dim]; a slot is
block_id * block_size + offset. Block-table entries past a sequence's context may hold anything (0, -1):
they are clamped before the gather and masked out by length, never trusted.
"""

import threading

import torch
import torch.nn.functional as F

# Per-thread scratch for the gathered K/V: a fresh multi-MB tensor page-faults on every call, which made batched
# CPU decode 2-3x slower. Buffers only grow (to the largest batch x context seen) and never escape a call.
_scratch = threading.local()
# SDPA's enable_gqa arrived in torch 2.5; pyproject allows 2.4, where K/V heads are repeated instead.
_SDPA_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def _scratch_buffer(name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    buffers = _scratch.__dict__.setdefault("buffers", {})
    # Inference tensors (made under torch.inference_mode, as the engine runs) cannot be written outside it, nor
    # normal tensors inside it without a version bump: keep one buffer per mode.
    key = (name, like.dtype, like.device, torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [N, Hkv, D] into the caches at slot_mapping [N]; slot -1 is padding, skipped."""
    assert key.shape == value.shape and key.dim() == 3, "key/value must be [N, Hkv, D]"
    assert slot_mapping.shape == (key.shape[0],), "slot_mapping must be [N]"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous to flatten slots"
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def _gather_context(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_tokens: int,
    lens: torch.Tensor | None = None,
    scratch: str | None = None,
) -> torch.Tensor:
    """Block ids [..., nb] -> contiguous K or V [..., num_tokens, Hkv, D] for the first num_tokens.

    With lens ([B] for a [B, nb] table), positions at or past a sequence's length read its position 0
    instead: padding then holds real, finite data (an unwritten slot may hold NaN bits, and 0 * NaN
    would leak through the masked softmax). With scratch, the result lives in that named per-thread buffer
    and is only valid until the next gather into the same name.
    """
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    ids = block_tables[..., :num_blocks].clamp(min=0).long()
    offsets = torch.arange(block_size, device=ids.device)
    slots = (ids[..., None] * block_size + offsets).flatten(-2)[..., :num_tokens]
    if lens is not None:
        live = torch.arange(num_tokens, device=ids.device)[None, :] < lens[:, None].to(ids.device)
        slots = torch.where(live, slots, slots[:, :1])
    # One index_select over flat slots copies exactly the live tokens (no padded tail block, no 5-D gather).
    flat = cache.view(-1, *cache.shape[2:])
    if scratch is None:
        gathered = flat.index_select(0, slots.reshape(-1))
    else:
        out = _scratch_buffer(scratch, slots.numel() * flat[0].numel(), cache).view(-1, *cache.shape[2:])
        gathered = torch.index_select(flat, 0, slots.reshape(-1), out=out)
    return gathered.view(*slots.shape, *cache.shape[2:])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [B, Hq, D], attending to its whole paged context.

    num_splits only matters to the Triton backend; it is accepted here so both backends share a signature.
    """
    del num_splits  # split-K is a GPU occupancy trick; one fused SDPA call already covers the batch here
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    group = num_heads // num_kv_heads
    if batch == 0:
        return torch.empty_like(q)
    max_len, slots, mask, empty = _decode_plan(block_tables, context_lens, k_cache.shape[1])
    k = _gather_slots(k_cache, slots, "k").view(batch, max_len, num_kv_heads, head_dim)
    v = _gather_slots(v_cache, slots, "v").view(batch, max_len, num_kv_heads, head_dim)
    # GQA without copies: the G query heads of one kv head become G query rows of a single SDPA "head".
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    compute = torch.float32
    out = F.scaled_dot_product_attention(
        qg.to(compute),
        k.transpose(1, 2).to(compute),
        v.transpose(1, 2).to(compute),
        attn_mask=mask,
        scale=scale,
    )
    return out.masked_fill(empty, 0.0).reshape(batch, num_heads, head_dim).to(q.dtype)


def _decode_plan(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int):
    """Gather slots and mask of one decode batch. Every layer of a step passes the same two tensors, so the plan is
    built once per step (keyed on their identity) instead of once per layer."""
    versions = (_version(block_tables), _version(context_lens), block_size)
    last = getattr(_scratch, "decode_plan", None)
    if last is not None and last[0] is block_tables and last[1] is context_lens and last[2] == versions:
        return last[3]
    max_len = max(int(context_lens.max()), 1)
    lens = context_lens.to(block_tables.device).long()
    num_blocks = -(-max_len // block_size)
    ids = block_tables[:, :num_blocks].clamp(min=0).long()
    offsets = torch.arange(block_size, device=ids.device)
    slots = (ids[..., None] * block_size + offsets).flatten(-2)[:, :max_len]
    positions = torch.arange(max_len, device=ids.device)
    live = positions[None, :] < lens[:, None]
    # Padding reads the row's position 0: real, finite data (an unwritten slot may hold NaN bits).
    slots = torch.where(live, slots, slots[:, :1]).reshape(-1)
    # A padded row (context 0) attends to position 0 to stay finite, then is zeroed, as the Triton kernel does.
    empty = (lens <= 0)[:, None, None, None]
    mask = live[:, None, None, :] | (empty & (positions == 0))  # [B, 1, 1, L]
    plan = (max_len, slots, mask, empty)
    _scratch.decode_plan = (block_tables, context_lens, versions, plan)
    return plan


def _version(t: torch.Tensor) -> int:
    """In-place writes bump a tensor's version, so a reused tensor with new contents gets a new plan."""
    try:
        return t._version
    except RuntimeError:  # inference tensors carry no version counter: they can't be written outside inference mode
        return -1


def _gather_slots(cache: torch.Tensor, slots: torch.Tensor, scratch: str) -> torch.Tensor:
    flat = cache.view(-1, *cache.shape[2:])
    out = _scratch_buffer(scratch, slots.numel() * flat[0].numel(), cache).view(-1, *cache.shape[2:])
    return torch.index_select(flat, 0, slots, out=out)


def _sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, group: int
) -> torch.Tensor:
    """SDPA with `group` query heads per kv head; mask None means plain causal (queries == keys)."""
    causal = mask is None
    if group > 1 and not _SDPA_GQA:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    elif group > 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen causal chunks q [T, Hq, D] whose K/V (and any earlier context) are already in the cache.

    Query i of sequence b sits at absolute position context_lens[b] - q_len + i and sees keys 0..that
    position: earlier chunks, prefix-cached blocks and itself.
    """
    total, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    group = num_heads // num_kv_heads
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    assert len(cu) == len(lens) + 1 and cu[-1] == total, "cu_seqlens_q must be [B+1] ending at T"
    out = torch.empty_like(q)
    compute = torch.float32
    for b, ctx in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        assert ctx >= q_len, f"sequence {b}: context_lens ({ctx}) must include its {q_len} new tokens"
        # 4-D [1, H, L, D]: with 3-D inputs CPU SDPA drops to its math path (3-4x slower than flash).
        k = _gather_context(k_cache, block_tables[b], ctx, scratch="k").transpose(0, 1)[None].to(compute)
        v = _gather_context(v_cache, block_tables[b], ctx, scratch="v").transpose(0, 1)[None].to(compute)
        qb = q[start:end].transpose(0, 1)[None].to(compute)  # [1, Hq, q_len, D]
        if ctx == q_len:
            o = _sdpa_gqa(qb, k, v, None, scale, group)
        else:
            rows = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= rows[:, None]  # [q_len, ctx]
            o = _sdpa_gqa(qb, k, v, mask, scale, group)
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)
    return out
