"""The small-M GEMM kernels and paged decode attention give each row bit for bit the same output whatever rows share
its call: alone, in a tile of any size the kernels use (2 to 8 rows), after a remainder, on the Q4_1 kernel's
one-pass path (up to 16 rows) and its tiled path above, beside rows of other context lengths. Speculative decoding
checks its drafts as extra rows of a decode step and keeps a draft only where the model's greedy token equals it, so
a row whose logits moved with the batch's shape would change the output: greedy output with speculation would differ
from plain decoding at near ties."""

import pytest
import torch

from tokenweir.engine.model.gguf_blocks import pack_q4_1
from tokenweir.engine.model.linear import _grouped_int8
from tokenweir.kernels.attention import reference as ref
from tokenweir.kernels.cpu.ops import int8_linear, paged_decode_attention, q4_1_linear, q8_linear


def q4_1_rows(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random Q4_1 blocks as a GGUF stores them: per 32 weights a float16 d and m, then 16 bytes of nibbles."""
    blocks = k // 32
    d = (torch.rand(n, blocks, generator=g) * 0.01 + 0.001).to(torch.float16)
    m = (torch.rand(n, blocks, generator=g) * -0.05).to(torch.float16)
    nibbles = torch.randint(0, 256, (n, blocks, 16), generator=g, dtype=torch.uint8)
    raw = torch.cat([d.view(torch.uint8).reshape(n, blocks, 2), m.view(torch.uint8).reshape(n, blocks, 2), nibbles], -1)
    return pack_q4_1(raw.reshape(n, blocks * 20))


@pytest.mark.parametrize("kernel", ["int8", "q8", "q8-two-planes", "q4_1", "q4_1-two-planes"])
@pytest.mark.parametrize("k", [576, 1536])
def test_a_row_is_the_same_alone_and_in_any_batch(kernel, k):
    g = torch.Generator().manual_seed(k)
    n = 200
    if kernel.startswith("q4_1"):
        packed = q4_1_rows(n, k, g)
        planes = 2 if kernel.endswith("two-planes") else 1

        def run(x):
            return q4_1_linear(x, packed, planes)
    else:
        q, scales = _grouped_int8(torch.randn(n, k, generator=g) * 0.05)
        planes = 2 if kernel.endswith("two-planes") else 1

        def run(x):
            return int8_linear(x, q, scales) if kernel == "int8" else q8_linear(x, q, scales, planes)

    x = torch.randn(19, k, generator=g)
    alone = torch.cat([run(x[i : i + 1]) for i in range(19)])
    for m in range(2, 20):
        assert torch.equal(run(x[:m]), alone[:m]), f"{kernel}: rows differ in a call of {m} rows"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_paged_decode_attention_gives_a_row_the_same_output_alone_and_batched(threads):
    g = torch.Generator().manual_seed(threads)
    num_blocks, block_size, num_kv_heads, heads, head_dim = 96, 16, 3, 9, 64
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    lens = [1, 70, 129, 300, 513, 64, 200, 17]  # under, at and over the 64-token split unit
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:40] for _ in lens]).to(torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    context = torch.tensor(lens, dtype=torch.int32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = paged_decode_attention(q, k_cache, v_cache, tables, context, 0.125)
        for i in range(len(lens)):
            alone = paged_decode_attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], context[i : i + 1], 0.125)
            assert torch.equal(alone[0], batched[i]), f"row {i} (context {lens[i]}) moved with the batch"
        reference = ref.paged_decode_attention(q, k_cache, v_cache, tables, context, 0.125)
        assert torch.allclose(batched, reference, atol=1e-5)
    finally:
        torch.set_num_threads(before)
