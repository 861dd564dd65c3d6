"""The C++ chunked-prefill attention (kernels/cpu/paged_prefill.cpp) against the torch reference: varlen chunks over
paged contexts (earlier chunks and prefix-cached blocks included), several grouped-query shapes and block sizes, q as
a strided view of a fused qkv projection, peaked softmaxes; and the cases it does not cover fall back to the
reference."""

import pytest
import torch

from tokenweir.engine.model.precision import cpu_flags
from tokenweir.kernels.attention import cpu_paged, reference
from tokenweir.kernels.cpu import ops as cpu_ops

BUILT = bool(cpu_flags() & {"avx512f", "avx2"})  # the kernel's ISAs (AVX2 with FMA)


def paged_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, chunks: list[tuple[int, int]]):
    """chunks: (chunk length, context length) per sequence -> (q, k_cache, v_cache, tables, cu_seqlens_q, lens)."""
    g = torch.Generator().manual_seed(num_heads * 101 + block_size + sum(c for _, c in chunks))
    num_blocks = sum(-(-c // block_size) for _, c in chunks) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(chunks), num_blocks), -1, dtype=torch.int32)  # -1 past each context: never read
    for row, (_, ctx) in enumerate(chunks):
        for i in range(-(-ctx // block_size)):
            tables[row, i] = order.pop()
    lengths = [q_len for q_len, _ in chunks]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    qkv = torch.randn(int(cu[-1]), num_heads + 2 * num_kv_heads, head_dim, generator=g) * 4  # peaked softmax
    lens = torch.tensor([ctx for _, ctx in chunks], dtype=torch.int32)
    return qkv[:, :num_heads], k_cache, v_cache, tables, cu, lens


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size,chunks",
    [
        (9, 3, 16, [(512, 512)]),  # a whole causal chunk (SmolLM2's heads)
        (9, 3, 16, [(512, 1024)]),  # the second chunk of a long prompt
        (9, 3, 16, [(7, 40), (1, 17), (0, 5), (100, 100), (33, 300)]),  # prefix-cached contexts, an empty chunk
        (4, 1, 8, [(70, 70), (20, 90)]),  # four query heads a kv head, blocks of 8
        (16, 16, 32, [(40, 100)]),  # no grouping, blocks of 32
        (32, 2, 16, [(10, 10), (3, 29)]),  # sixteen query heads a kv head: one position a task
    ],
)
def test_prefill_kernel_equals_the_torch_reference(num_heads, num_kv_heads, block_size, chunks):
    q, k_cache, v_cache, tables, cu, lens = paged_case(num_heads, num_kv_heads, 64, block_size, chunks)
    scale = 64**-0.5
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cpu_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale)
    finally:
        torch.set_num_threads(threads)
    want = reference.paged_prefill_attention(q.contiguous(), k_cache, v_cache, tables, cu, lens, scale)
    if not BUILT:
        assert got is None  # the engine then takes the reference
        return
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 32), (17, 1, 64)])
def test_cases_the_kernel_does_not_cover_go_to_the_reference(num_heads, num_kv_heads, head_dim):
    q, k_cache, v_cache, tables, cu, lens = paged_case(num_heads, num_kv_heads, head_dim, 16, [(20, 50)])
    scale = head_dim**-0.5
    assert cpu_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale) is None
    got = cpu_paged.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale)
    want = reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size,chunks",
    [
        (9, 3, 16, [(512, 512)]),
        (9, 3, 16, [(7, 40), (1, 17), (0, 5), (100, 100), (33, 300)]),  # odd tails: half-filled key pairs
        (32, 2, 16, [(10, 10), (3, 29)]),
    ],
)
def test_bf16_dot_products_equal_the_reference_on_rounded_inputs(num_heads, num_kv_heads, block_size, chunks):
    """With bf16=True the kernel rounds q, k, v and the probabilities to bfloat16 and sums in float32: against the
    reference on the same rounded q, k, v (in float64) only the probabilities' rounding is left (a few 1e-3 of the
    values' scale); the float32 kernel's answer differs where the CPU has bf16 dot products, and is the answer
    where it has not."""
    q, k_cache, v_cache, tables, cu, lens = paged_case(num_heads, num_kv_heads, 64, block_size, chunks)
    scale = 64**-0.5
    got = cpu_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, bf16=True)
    if not BUILT:
        assert got is None
        return
    f32 = cpu_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale)
    if "avx512_bf16" not in cpu_flags():
        torch.testing.assert_close(got, f32, rtol=0, atol=0)
        return
    rounded = [bf16_round(t).double() for t in (q.contiguous(), k_cache, v_cache)]
    want = reference.paged_prefill_attention(*rounded, tables, cu, lens, scale).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert (got - want).abs().mean() < 3e-3
    assert (got - f32).abs().max() > 1e-3  # the bfloat16 path ran
