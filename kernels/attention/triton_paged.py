"""Triton paged attention (decode with split-K, varlen chunked prefill) and the KV-cache write.

Same signatures as kernels/attention/reference.py. Cache layout per layer: [num_blocks, block_size, Hkv, D], a slot is
block_id * block_size + offset. Kernels walk the context in tiles of BLOCK_N tokens and look up each token's
block id, so any power-of-two block size works and block-table entries past a context are never read.
Scores run in the log2 domain (exp2 with scale * log2(e)); softmax statistics and accumulators are fp32.
Under TRITON_INTERPRET=1 the same code runs on CPU tensors (float32 only), which is how the tests run it.
"""

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 256
DECODE_BLOCK_N = 64
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _scratch(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Interpreted (test) runs NaN-fill scratch so a partial that a program forgot to write poisons the output.
    if _interpreting():
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)
    return torch.empty(shape, dtype=torch.float32, device=device)


def _check_device(*tensors: torch.Tensor) -> None:
    if _interpreting():
        assert all(t.dtype != torch.bfloat16 and t.dtype != torch.float16 for t in tensors), (
            "the Triton interpreter runs float32 only: use float32 tensors or the torch backend"
        )
    else:
        assert all(t.is_cuda for t in tensors), (
            "Triton kernels need CUDA tensors; on CPU use the torch backend (or TRITON_INTERPRET=1 in tests)"
        )


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches (CPU interpreter, debugging) get exact products; fp16/bf16 use tensor cores as they are.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    valid = tl.full([BLOCK_H, HEAD_DIM], 0, tl.int64) + slot >= 0  # slot -1 = padded token: write nothing
    mask = (h < NUM_KV_HEADS) & valid
    k = tl.load(key_ptr + token * stride_kn + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vn + h * stride_vh + d, mask=mask)
    dst = slot * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [N, Hkv, D] into the caches at slot_mapping [N]; slot -1 is padding, skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,), "key/value [N, Hkv, D], slots [N]"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), "cache shape"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    _check_device(key, k_cache)
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
    )  # fmt: skip


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr, qk_scale,
    stride_qb, stride_qh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # One program = one sequence x one kv head x one slice of its context. The GROUP query heads sharing the
    # kv head are rows of one tile, so each K/V tile is loaded once for all of them (GQA/MQA for free).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    # Each sequence cuts its own context into NUM_SPLITS slices (BLOCK_N-aligned); late slices may be empty.
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < end
        block = tl.load(table + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        row = block * stride_cb + (tok % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i >= 1 for real rows; context 0 gives 0
        o_ptr = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # Unnormalised partials [B, Hq, S, D] and (m, l) [B, Hq, S, 2]; an empty slice stores m=-inf, l=0, acc=0.
        part = (seq * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    s_mask = s < NUM_SPLITS
    part = (seq * NUM_HEADS + head) * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)  # noqa: E741
    # Slice 0 holds a token whenever the context is non-empty; a padded row (context 0) has every m = -inf and
    # comes out 0, like the single-pass kernel, rather than NaN.
    m_max = tl.maximum(tl.max(m, 0), -1e30)
    w = tl.where(s_mask, tl.exp2(m - m_max), 0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None], other=0.0)
    denom = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def pick_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Split-K only when batch x kv heads cannot fill the GPU, and never below MIN_TOKENS_PER_SPLIT per slice."""
    programs = batch * num_kv_heads
    want = triton.cdiv(2 * num_sms, programs)
    by_length = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, by_length, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [B, Hq, D], over its paged context; split-K over the context.

    num_splits: None picks by occupancy (no host sync: it bounds the context by the block-table width),
    1 runs the single-pass kernel. `out` ([B, Hq, D]) lets a caller (or a test) supply the output buffer.
    """
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, "cache shape"
    assert num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride(), "caches share a D-contiguous layout"
    assert q.stride(2) == 1 and block_tables.stride(1) == 1, "q rows and block tables must be contiguous"
    assert head_dim & (head_dim - 1) == 0 and block_size & (block_size - 1) == 0, "powers of two"
    _check_device(q, k_cache)
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1, "out must be [B, Hq, D] with contiguous rows"
    if batch == 0:
        return out
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = pick_num_splits(batch, num_kv_heads, max_context, _num_sms(q.device))
    assert 1 <= num_splits <= 1024, "num_splits out of range"
    if num_splits > 1:
        part_acc = _scratch((batch, num_heads, num_splits, head_dim), q.device)
        part_ml = _scratch((batch, num_heads, num_splits, 2), q.device)
    else:
        part_acc = part_ml = out  # unused by the single-pass kernel
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_acc, part_ml, scale * LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(k_cache.dtype), num_warps=4,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4,
        )  # fmt: skip
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr, out_ptr, qk_scale,
    stride_qt, stride_qh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # One program = BLOCK_M queries of one sequence x one query head, over the paged context (prior chunks,
    # prefix-cached blocks and the chunk itself, already stored), causal with the chunk's offset.
    q_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len  # absolute position of the chunk's first query

    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < q_len
    d = tl.arange(0, HEAD_DIM)
    q_off = (q_start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=r_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Keys up to the last query of this block; a block past the chunk's end (grid padding) loops zero times.
    kv_end = tl.minimum(ctx, prefix + (q_block + 1) * BLOCK_M)
    kv_end = tl.where(q_block * BLOCK_M < q_len, kv_end, 0)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < kv_end
        block = tl.load(table + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        row = block * stride_cb + (tok % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = t_mask[None, :] & (tok[None, :] <= (prefix + rows)[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite after tile 0: key 0 is visible to every row
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i >= 1 for real rows; padded rows are not stored
    o_off = (q_start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_seqlen_q: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal chunks q [T, Hq, D] whose K/V (and any earlier context) are already in the cache.

    max_seqlen_q sizes the grid; pass it to skip a device->host sync. `out` ([T, Hq, D]) is an optional buffer.
    """
    total, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    batch = context_lens.shape[0]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, "cache shape"
    assert num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride(), "caches share a D-contiguous layout"
    assert q.stride(2) == 1 and block_tables.stride(1) == 1, "q rows and block tables must be contiguous"
    assert cu_seqlens_q.shape == (batch + 1,), "cu_seqlens_q must be [B+1]"
    _check_device(q, k_cache)
    assert head_dim & (head_dim - 1) == 0 and block_size & (block_size - 1) == 0, "powers of two"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1, "out must be [T, Hq, D] with contiguous rows"
    if total == 0 or batch == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_q == 0:
        return out
    grid = (math.ceil(max_seqlen_q / PREFILL_BLOCK_M), num_heads, batch)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, DOT_PRECISION=_dot_precision(k_cache.dtype),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out
