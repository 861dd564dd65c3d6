"""Paged decode / prefill attention: Triton (interpreted) == torch reference == dense naive attention.

Caches are NaN everywhere no sequence wrote (spare blocks, the tail of each last block) and block tables hold
-1 past each context, so a kernel that reads outside a context returns NaN; Triton outputs are NaN-poisoned
before the call so an element no program wrote fails too.
"""

import pytest
import torch

from tests.support.kernel_cases import DEVICE, make_paged_batch, naive_attention, randn
from tokenweir.kernels.attention import reference, triton_paged

ATOL = 2e-5

# (head_dim, Hq, Hkv, block_size): GQA ratios 1, 3 and 8 (8 also as MQA), head_dim 64/128, blocks 16/32.
SHAPES = [
    pytest.param(64, 4, 4, 16, id="d64-mha-bs16"),
    pytest.param(128, 6, 2, 32, id="d128-gqa3-bs32"),
    pytest.param(64, 9, 3, 16, id="d64-gqa3-bs16-smollm"),
    pytest.param(128, 8, 1, 16, id="d128-mqa8-bs16"),
    pytest.param(64, 16, 2, 32, id="d64-gqa8-bs32"),
]
# Mixed in one batch: 1 token, exactly one block, one past a block, and long non-multiples of both sizes.
DECODE_LENS = [1, 16, 33, 170, 301]


def test_kernels_are_interpreted_exactly_without_a_gpu():
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = DEVICE.type == "cpu"
    assert isinstance(triton_paged._decode_kernel, InterpretedFunction) == interpreted
    assert isinstance(triton_paged._prefill_kernel, InterpretedFunction) == interpreted
    assert isinstance(triton_paged._store_kv_kernel, InterpretedFunction) == interpreted


@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads", "block_size"), SHAPES)
def test_decode_matches_naive(head_dim, num_heads, num_kv_heads, block_size):
    gen = torch.Generator().manual_seed(head_dim * 1000 + num_heads * 10 + block_size)
    batch = make_paged_batch(DECODE_LENS, num_kv_heads, head_dim, block_size, gen)
    q = randn(len(DECODE_LENS), num_heads, head_dim, gen=gen)
    scale = head_dim**-0.5
    expected = torch.stack(
        [
            naive_attention(q[b : b + 1], k, v, torch.tensor([n - 1]), scale)[0]
            for b, (n, k, v) in enumerate(zip(DECODE_LENS, batch.keys, batch.values, strict=True))
        ]
    )
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale)

    torch.testing.assert_close(reference.paged_decode_attention(*args), expected, atol=ATOL, rtol=0)
    # 1 = single pass; 4 = split-K with a reduce (the 1-token sequence leaves 3 of its 4 slices empty).
    for num_splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        got = triton_paged.paged_decode_attention(*args, num_splits=num_splits, out=out)
        assert got is out
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=f"num_splits={num_splits}")


def test_decode_many_splits_and_default_heuristic():
    gen = torch.Generator().manual_seed(7)
    lens = [2, 65, 200]
    batch = make_paged_batch(lens, 2, 64, 16, gen)
    q = randn(len(lens), 6, 64, gen=gen)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125)
    expected = reference.paged_decode_attention(*args)
    # More slices than tiles: most slices are empty and must drop out of the reduce.
    torch.testing.assert_close(triton_paged.paged_decode_attention(*args, num_splits=9), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(triton_paged.paged_decode_attention(*args), expected, atol=ATOL, rtol=0)


# Each case: (q_len, context_len) per sequence. q_len == context is a fresh prompt; q_len < context is a later
# chunk of a chunked prefill or a prompt behind prefix-cached blocks; q_len 1 is a decode through this path;
# q_len 0 is a sequence with nothing to compute this step.
PREFILL_CASES = [
    pytest.param(64, 9, 3, 16, [(40, 40), (70, 131), (1, 17), (90, 90)], id="d64-gqa3-bs16-smollm"),
    pytest.param(128, 4, 4, 32, [(33, 33), (17, 300), (65, 96)], id="d128-mha-bs32"),
    pytest.param(64, 8, 1, 32, [(1, 1), (50, 82), (0, 20), (129, 129)], id="d64-mqa8-bs32"),
    pytest.param(128, 16, 2, 16, [(20, 52), (31, 31)], id="d128-gqa8-bs16"),
]


@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads", "block_size", "chunks"), PREFILL_CASES)
def test_prefill_matches_naive(head_dim, num_heads, num_kv_heads, block_size, chunks):
    gen = torch.Generator().manual_seed(head_dim + num_heads + block_size)
    q_lens = [q_len for q_len, _ in chunks]
    ctx_lens = [ctx for _, ctx in chunks]
    batch = make_paged_batch(ctx_lens, num_kv_heads, head_dim, block_size, gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = randn(int(cu[-1]), num_heads, head_dim, gen=gen)
    scale = head_dim**-0.5
    expected = torch.cat(
        [
            naive_attention(q[cu[b] : cu[b + 1]], k, v, torch.arange(ctx - q_len, ctx), scale)
            for b, (q_len, ctx, k, v) in enumerate(zip(q_lens, ctx_lens, batch.keys, batch.values, strict=True))
        ]
    )
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, cu, batch.context_lens, scale)

    torch.testing.assert_close(reference.paged_prefill_attention(*args), expected, atol=ATOL, rtol=0)
    out = torch.full_like(q, float("nan"))
    got = triton_paged.paged_prefill_attention(*args, out=out)
    assert got is out
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(
        triton_paged.paged_prefill_attention(*args, max_seqlen_q=max(q_lens)), expected, atol=ATOL, rtol=0
    )


def test_prefill_chunks_compose_to_full_prompt():
    """Prefilling a prompt in chunks gives the same rows as prefilling it at once (what chunked prefill needs)."""
    gen = torch.Generator().manual_seed(11)
    n = 150
    batch = make_paged_batch([n], 3, 64, 16, gen)
    q = randn(n, 9, 64, gen=gen)
    scale = 0.125
    whole_args = (batch.k_cache, batch.v_cache, batch.block_tables)
    for impl in (reference, triton_paged):
        whole = impl.paged_prefill_attention(
            q,
            *whole_args,
            torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
            torch.tensor([n], dtype=torch.int32, device=DEVICE),
            scale,
        )
        parts = [
            impl.paged_prefill_attention(
                q[a:b],
                *whole_args,
                torch.tensor([0, b - a], dtype=torch.int32, device=DEVICE),
                torch.tensor([b], dtype=torch.int32, device=DEVICE),
                scale,
            )  # fmt: skip
            for a, b in [(0, 64), (64, 100), (100, n)]
        ]
        torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=0, msg=impl.__name__)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision_caches(dtype):
    """The torch path accumulates in fp32 whatever the cache dtype (CUDA fallback, bf16 CPU runs)."""
    gen = torch.Generator().manual_seed(3)
    lens = [5, 40]
    batch = make_paged_batch(lens, 2, 64, 16, gen)
    q = randn(2, 4, 64, gen=gen)
    k_cache = batch.k_cache.nan_to_num(0.0).to(dtype)
    v_cache = batch.v_cache.nan_to_num(0.0).to(dtype)
    got = reference.paged_decode_attention(q.to(dtype), k_cache, v_cache, batch.block_tables, batch.context_lens, 0.125)
    assert got.dtype == dtype
    expected = reference.paged_decode_attention(
        q.to(dtype).float(), k_cache.float(), v_cache.float(), batch.block_tables, batch.context_lens, 0.125
    )
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_pick_num_splits():
    # A lone long sequence on a 132-SM GPU splits up to the cap; a full batch does not split.
    assert triton_paged.pick_num_splits(1, 8, 8192, 132) == triton_paged.MAX_SPLITS
    assert triton_paged.pick_num_splits(64, 8, 8192, 132) == 1
    # Short contexts are never cut below MIN_TOKENS_PER_SPLIT tokens per slice.
    assert triton_paged.pick_num_splits(1, 3, 600, 132) == 2
    assert triton_paged.pick_num_splits(1, 3, 100, 132) == 1


@pytest.mark.parametrize("block_size", [8, 128])
def test_block_sizes_smaller_and_larger_than_a_tile(block_size):
    """Kernels tile the context by tokens, not blocks: pages of 8 (< a tile) and 128 (> a tile) both work."""
    gen = torch.Generator().manual_seed(block_size)
    lens, q_lens = [1, 9, 130], [1, 9, 40]
    batch = make_paged_batch(lens, 2, 64, block_size, gen)
    scale = 0.125
    q = randn(len(lens), 6, 64, gen=gen)
    decode_args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale)
    expected = torch.stack(
        [
            naive_attention(q[b : b + 1], k, v, torch.tensor([n - 1]), scale)[0]
            for b, (n, k, v) in enumerate(zip(lens, batch.keys, batch.values, strict=True))
        ]
    )
    torch.testing.assert_close(reference.paged_decode_attention(*decode_args), expected, atol=ATOL, rtol=0)
    got = triton_paged.paged_decode_attention(*decode_args, num_splits=3, out=torch.full_like(q, float("nan")))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)

    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    qp = randn(int(cu[-1]), 6, 64, gen=gen)
    expected = torch.cat(
        [
            naive_attention(qp[cu[b] : cu[b + 1]], k, v, torch.arange(n - ql, n), scale)
            for b, (ql, n, k, v) in enumerate(zip(q_lens, lens, batch.keys, batch.values, strict=True))
        ]
    )
    prefill_args = (qp, batch.k_cache, batch.v_cache, batch.block_tables, cu, batch.context_lens, scale)
    torch.testing.assert_close(reference.paged_prefill_attention(*prefill_args), expected, atol=ATOL, rtol=0)
    got = triton_paged.paged_prefill_attention(*prefill_args, out=torch.full_like(qp, float("nan")))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_empty_batches():
    cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    no_tables = torch.zeros(0, 1, dtype=torch.int32, device=DEVICE)
    no_lens = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    for impl in (reference, triton_paged):
        q = torch.empty(0, 4, 64, device=DEVICE)
        assert impl.paged_decode_attention(q, cache, cache, no_tables, no_lens, 0.125).shape == (0, 4, 64)
        cu = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        assert impl.paged_prefill_attention(q, cache, cache, no_tables, cu, no_lens, 0.125).shape == (0, 4, 64)


def test_decode_padded_rows_with_empty_context_are_zero():
    """A row with context 0 (a padded batch slot, e.g. for CUDA graphs) gives 0, not NaN, and spoils no other row."""
    gen = torch.Generator().manual_seed(13)
    batch = make_paged_batch([70, 5], 2, 64, 16, gen)
    q = randn(3, 4, 64, gen=gen)
    tables = torch.cat([batch.block_tables, torch.full_like(batch.block_tables[:1], -1)])
    lens = torch.tensor([70, 5, 0], dtype=torch.int32, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, tables, lens, 0.125)
    expected = reference.paged_decode_attention(q[:2], *args[1:3], tables[:2], lens[:2], 0.125)
    outs = {"torch": reference.paged_decode_attention(*args)}
    for num_splits in (1, 3):
        outs[f"triton-s{num_splits}"] = triton_paged.paged_decode_attention(*args, num_splits=num_splits)
    for name, out in outs.items():
        torch.testing.assert_close(out[:2], expected, atol=ATOL, rtol=0, msg=name)
        assert torch.equal(out[2], torch.zeros_like(out[2])), name


def test_reference_prefill_on_torch_without_sdpa_gqa(monkeypatch):
    """torch 2.4 (allowed by pyproject) has no enable_gqa: the reference repeats kv heads and still matches."""
    monkeypatch.setattr(reference, "_SDPA_GQA", False)
    gen = torch.Generator().manual_seed(17)
    chunks = [(30, 30), (12, 45)]
    batch = make_paged_batch([ctx for _, ctx in chunks], 3, 64, 16, gen)
    cu = torch.tensor([0, 30, 42], dtype=torch.int32, device=DEVICE)
    q = randn(42, 9, 64, gen=gen)
    expected = torch.cat(
        [
            naive_attention(q[:30], batch.keys[0], batch.values[0], torch.arange(30), 0.125),
            naive_attention(q[30:], batch.keys[1], batch.values[1], torch.arange(33, 45), 0.125),
        ]
    )
    got = reference.paged_prefill_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables, cu, batch.context_lens, 0.125
    )
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_reference_decode_splits_a_ragged_batch_into_length_groups():
    """The CPU path pads each length group only to its own longest row; the groups' rows go back in batch order."""
    lens = [3, 900, 17, 450, 1, 880, 40]
    gen = torch.Generator().manual_seed(11)
    batch = make_paged_batch(lens, 3, 64, 16, gen)
    q = randn(len(lens), 9, 64, gen=gen)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125)
    assert len(reference._length_groups(lens)) > 1
    expected = torch.stack(
        [
            naive_attention(q[b : b + 1], k, v, torch.tensor([n - 1]), 0.125)[0]
            for b, (n, k, v) in enumerate(zip(lens, batch.keys, batch.values, strict=True))
        ]
    )
    torch.testing.assert_close(reference.paged_decode_attention(*args), expected, atol=ATOL, rtol=0)


def test_length_groups_cover_every_row_once_and_split_only_when_padding_costs_more():
    assert sorted(sum(reference._length_groups([5, 5, 5, 5]), [])) == [0, 1, 2, 3]
    assert len(reference._length_groups([100, 101, 99])) == 1
    groups = reference._length_groups([4000, 10, 12, 3990])
    assert sorted(sorted(g) for g in groups) == [[0, 3], [1, 2]]
