"""Torch paged attention and KV-cache write: the CPU engine's hot path and the Triton kernels' oracle.

Cache layout per layer: k_cache / v_cache are [num_blocks, block_size, num_kv_heads, head_dim]; a slot is
block_id * block_size + offset. Block-table entries past a sequence's context may hold anything (0, -1):
they are clamped before the gather and masked out by length, never trusted.
"""

import threading
from dataclasses import dataclass

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


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, scratch: str) -> torch.Tensor:
    """One sequence's block ids [nb] -> its first num_tokens keys or values, head-major [Hkv, num_tokens, D], in the
    named per-thread scratch buffer (valid until the next gather into the same name)."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    ids = block_table[:num_blocks].clamp(min=0).long()
    offsets = torch.arange(block_size, device=ids.device)
    slots = (ids[:, None] * block_size + offsets).flatten()[:num_tokens]
    return _gather_head_major(cache, slots, scratch)


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
    del num_splits  # split-K is a GPU occupancy trick; one fused SDPA call per length group covers the batch here
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    if batch == 0:
        return torch.empty_like(q)
    groups = _decode_plan(block_tables, context_lens, k_cache.shape[1])
    if len(groups) == 1:
        return _decode_group(q, k_cache, v_cache, groups[0], scale)
    out = torch.empty_like(q)
    for group in groups:
        out.index_copy_(0, group.rows, _decode_group(q.index_select(0, group.rows), k_cache, v_cache, group, scale))
    return out


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # which rows of the batch this group holds
    max_len: int  # every row's context is padded to this
    slots: torch.Tensor  # [rows * max_len] cache slots to gather
    mask: torch.Tensor  # [rows, 1, 1, max_len] True where a key is live
    empty: torch.Tensor  # [rows, 1, 1, 1] True for a padded row (context 0), whose output is zeroed


def _decode_group(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _DecodeGroup, scale: float
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = _gather_head_major(k_cache, group.slots, "k").view(num_kv_heads, batch, group.max_len, head_dim)
    v = _gather_head_major(v_cache, group.slots, "v").view(num_kv_heads, batch, group.max_len, head_dim)
    # GQA without copies: the G query heads of one kv head become G query rows of a single SDPA "head".
    qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    compute = torch.float32
    out = F.scaled_dot_product_attention(
        qg.to(compute),
        k.transpose(0, 1).to(compute),
        v.transpose(0, 1).to(compute),
        attn_mask=group.mask,
        scale=scale,
    )
    return out.masked_fill(group.empty, 0.0).reshape(batch, num_heads, head_dim).to(q.dtype)


# Cost of one more length group, in gathered tokens: a group is a K gather, a V gather and an SDPA call (~100 us on
# CPU), while one padded token costs ~0.3 us to gather and attend over.
_GROUP_COST_TOKENS = 256


def _length_groups(lens: list[int]) -> list[list[int]]:
    """Split rows into groups padded to their longest member, minimising padded tokens + a cost per group.

    Contexts in a decode batch range from tens to thousands of tokens; padding every row to the longest one made the
    gather and SDPA do about twice the work. Rows sorted by length make the optimal split contiguous: an O(B^2) DP.
    """
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    longest = [max(lens[i], 1) for i in order]
    best = [0] + [0] * len(order)
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        best[end], cut[end] = min(
            (best[start] + (end - start) * longest[start] + _GROUP_COST_TOKENS, start) for start in range(end)
        )
    groups, end = [], len(order)
    while end > 0:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups


def _decode_plan(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> list[_DecodeGroup]:
    """Length groups, gather slots and masks of one decode batch. Every layer of a step passes the same two tensors,
    so the plan is built once per step (keyed on their identity) instead of once per layer."""
    versions = (_version(block_tables), _version(context_lens), block_size)
    last = getattr(_scratch, "decode_plan", None)
    if last is not None and last[0] is block_tables and last[1] is context_lens and last[2] == versions:
        return last[3]
    lens_list = context_lens.tolist()
    groups = _length_groups(lens_list)
    if len(groups) == 1:
        groups = [list(range(len(lens_list)))]  # keep batch order: no index_select / index_copy needed
    plan = []
    for rows in groups:
        max_len = max(max(lens_list[i] for i in rows), 1)
        row_ids = torch.tensor(rows, dtype=torch.long, device=block_tables.device)
        lens = context_lens.to(block_tables.device).long().index_select(0, row_ids)
        num_blocks = -(-max_len // block_size)
        ids = block_tables.index_select(0, row_ids)[:, :num_blocks].clamp(min=0).long()
        offsets = torch.arange(block_size, device=ids.device)
        slots = (ids[..., None] * block_size + offsets).flatten(-2)[:, :max_len]
        positions = torch.arange(max_len, device=ids.device)
        live = positions[None, :] < lens[:, None]
        # Padding reads the row's position 0: real, finite data (an unwritten slot may hold NaN bits).
        slots = torch.where(live, slots, slots[:, :1]).reshape(-1)
        # A padded row (context 0) attends to position 0 to stay finite, then is zeroed, as the Triton kernel does.
        empty = (lens <= 0)[:, None, None, None]
        mask = live[:, None, None, :] | (empty & (positions == 0))  # [B, 1, 1, L]
        plan.append(_DecodeGroup(row_ids, max_len, slots, mask, empty))
    _scratch.decode_plan = (block_tables, context_lens, versions, plan)
    return plan


def _version(t: torch.Tensor) -> int:
    """In-place writes bump a tensor's version, so a reused tensor with new contents gets a new plan."""
    try:
        return t._version
    except RuntimeError:  # inference tensors carry no version counter: they can't be written outside inference mode
        return -1


def _gather_head_major(cache: torch.Tensor, slots: torch.Tensor, scratch: str) -> torch.Tensor:
    """[Hkv, len(slots), D]: CPU SDPA runs ~1.5x faster when each head's keys are contiguous rows, and one
    index_select per head costs less than transposing a token-major gather afterwards."""
    flat = cache.view(-1, *cache.shape[2:])
    num_kv_heads, head_dim = cache.shape[2:]
    out = _scratch_buffer(scratch, slots.numel() * num_kv_heads * head_dim, cache).view(num_kv_heads, -1, head_dim)
    for head in range(num_kv_heads):
        torch.index_select(flat[:, head], 0, slots, out=out[head])
    return out


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
        k = _gather_context(k_cache, block_tables[b], ctx, scratch="k")[None].to(compute)
        v = _gather_context(v_cache, block_tables[b], ctx, scratch="v")[None].to(compute)
        qb = q[start:end].transpose(0, 1)[None].to(compute)  # [1, Hq, q_len, D]
        if ctx == q_len:
            o = _sdpa_gqa(qb, k, v, None, scale, group)
        else:
            rows = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= rows[:, None]  # [q_len, ctx]
            o = _sdpa_gqa(qb, k, v, mask, scale, group)
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)
    return out
