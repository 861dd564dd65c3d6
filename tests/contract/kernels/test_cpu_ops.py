"""The C++ CPU kernels against torch: the int8 weight-only GEMM equals float32 matmul on the same dequantized weights
for every small M (its register tiles of 4, 3, 2, 1 rows), grouped and per-row scales, and K with a tail past the
vector width; the int8 x int8 GEMM rounds activations exactly as llama.cpp's quantize_row_q8_0 and equals the
integer dot products of the rounded rows, scaled, up to float rounding, on the model's shapes; Int8Linear's decode
and prefill paths agree; the paged decode attention equals the torch reference for GQA, scattered blocks, partial
last blocks, empty rows and contexts split across threads; the fused RMSNorm, RoPE and SiLU-gating equal the model's
torch code."""

import pytest
import torch

from tokenweir.engine.model.linear import Int8Linear, _dequantize, _grouped_int8, make_linear
from tokenweir.kernels.attention import reference
from tokenweir.kernels.cpu.ops import int8_linear, load, paged_decode_attention, q8_linear, q8_quantize


def test_the_kernel_builds_on_this_machine():
    assert load() is not None


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 64), (44, 37)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9])
def test_kernel_equals_float32_matmul_on_the_dequantized_weight(k, n, m):
    g = torch.Generator().manual_seed(k * 100 + m)
    weight = torch.randn(n, k, generator=g) * 0.05
    q, scales = _grouped_int8(weight)
    assert scales.shape == (n, k // 32 if k % 32 == 0 else 1)
    x = torch.randn(m, k, generator=g)
    expected = x.double() @ _dequantize(q, scales).double().t()
    torch.testing.assert_close(int8_linear(x, q, scales).double(), expected, rtol=1e-5, atol=1e-5)


def test_grouped_int8_rounds_each_weight_to_within_half_a_step():
    weight = torch.randn(64, 576) * torch.logspace(-3, 0, 576)  # columns of very different scales
    q, scales = _grouped_int8(weight)
    error = (_dequantize(q, scales) - weight).abs().reshape(64, 18, 32)
    assert (error <= scales[:, :, None] / 2 + 1e-7).all()


def q8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's quantize_row_q8_0 in torch: per 32 values, d = amax / 127, q = round-half-even(x * (127 / amax))."""
    m, k = x.shape
    groups = x.reshape(m, k // 32, 32)
    amax = groups.abs().amax(dim=2)
    # torch.div, not `127 / amax`: a scalar over a tensor is computed as 127 * (1 / amax), one more rounding.
    inverse = torch.where(amax != 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))
    return (groups * inverse[:, :, None]).round().to(torch.int8).reshape(m, k), amax / 127


def q8_linear_reference(x, q, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, the sum of |each group's term|): every group's dot product in integers, scaled by the two groups' scales."""
    xq, xd = q8_reference(x)
    m, k = x.shape
    n, groups = scales.shape
    # Integer products of at most 127 * 127, 32 a group: every partial sum is exact in float32.
    dots = torch.bmm(
        xq.reshape(m, groups, 32).float().transpose(0, 1), q.reshape(n, groups, 32).float().permute(1, 2, 0)
    ).permute(1, 2, 0)  # [m, n, groups]
    terms = dots.double() * (xd[:, None, :] * scales[None, :, :]).double()
    return terms.sum(2), terms.abs().sum(2)


def test_q8_quantize_rounds_as_llama_cpp():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 1536, generator=g) * torch.logspace(-4, 1, 1536)
    x[1, 64:96] = 0  # an all-zero group: scale 0, values 0
    x[2, :32] = torch.arange(32) - 15.5
    x[2, 31] = 127.0  # amax 127: x * 127 / amax = x, every other value a tie
    q, d = q8_quantize(x)
    want_q, want_d = q8_reference(x)
    assert torch.equal(q, want_q)
    assert torch.equal(d, want_d)
    assert q.abs().max() <= 127  # never -128, which the sign trick could not negate
    assert (d[1, 2] == 0).item() and (q[1, 64:96] == 0).all()
    assert q[2, 16:19].tolist() == [0, 2, 2]  # 0.5, 1.5, 2.5: ties to even, as _mm256_round_ps does


@pytest.mark.parametrize(
    "k,n", [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 960), (576, 3072), (576, 49152), (576, 6)]
)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_q8_linear_equals_the_integer_dots_of_the_rounded_rows(k, n, m):
    g = torch.Generator().manual_seed(k + n + m)
    q, scales = _grouped_int8(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(m, k, generator=g)
    x[0, 5] = 40.0  # an outlier coarsens its own group only
    want, magnitude = q8_linear_reference(x, q, scales)
    error = (q8_linear(x, q, scales).double() - want).abs()
    assert (error <= 1e-5 * magnitude + 1e-12).all()


def test_q8_linear_stays_close_to_the_weight_only_kernel():
    g = torch.Generator().manual_seed(9)
    q, scales = _grouped_int8(torch.randn(1536, 576, generator=g) * 0.05)
    x = torch.randn(16, 576, generator=g)
    weight_only = int8_linear(x, q, scales)
    relative = (q8_linear(x, q, scales) - weight_only).norm() / weight_only.norm()
    assert relative.item() < 0.01  # about 0.5%: the activations' own rounding


def test_q8_linear_refuses_k_that_32_does_not_divide_and_int8linear_keeps_the_weight_only_kernel():
    q, scales = _grouped_int8(torch.randn(8, 44))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q8_linear(torch.randn(2, 44), q, scales)
    layer = Int8Linear(torch.randn(8, 44))
    assert not layer.int8_activations
    x = torch.randn(2, 44)
    torch.testing.assert_close(layer(x), int8_linear(x, layer.weight, layer.scales))


@pytest.mark.parametrize("int8_activations", [False, True])
def test_int8_linear_answers_the_same_on_the_decode_and_the_prefill_path(int8_activations):
    weight = torch.randn(300, 576) * 0.05
    layer = make_linear(weight, torch.float32, "w8a8" if int8_activations else "int8")
    assert isinstance(layer, Int8Linear) and layer.int8_activations == int8_activations
    x = torch.randn(Int8Linear.SMALL_M + 8, 576)
    big = layer(x)  # dequantize + matmul
    small = torch.cat([layer(x[: Int8Linear.SMALL_M]), layer(x[Int8Linear.SMALL_M :])])
    if int8_activations:  # the decode path rounds the activations too
        assert ((small - big).norm() / big.norm()).item() < 0.01
    else:
        torch.testing.assert_close(big, small, rtol=1e-4, atol=1e-5)
    dense = x @ weight.t()
    assert ((big - dense).norm() / dense.norm()).item() < 0.01
    assert ((small - dense).norm() / dense.norm()).item() < 0.01


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 2, 24)])
def test_paged_decode_attention_equals_the_torch_reference(num_heads, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(num_heads * 31 + head_dim)
    block_size, num_blocks = 16, 64
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    lens = [1, 17, 0, 100, 255, 16]
    tables = torch.full((len(lens), 16), -1, dtype=torch.int32)  # -1 past each context: never read
    order = torch.randperm(num_blocks, generator=g).tolist()
    for row, n in enumerate(lens):
        for i in range(-(-n // block_size)):
            tables[row, i] = order.pop()
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
    got = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[2] == 0).all()  # an empty row stays zero, as on the Triton backend


@pytest.mark.parametrize("num_heads,num_kv_heads,lens", [(9, 3, [600]), (9, 3, [130]), (4, 1, [0, 200, 131])])
def test_paged_decode_attention_split_over_the_context_equals_the_torch_reference(num_heads, num_kv_heads, lens):
    """Fewer (sequence, kv head) tasks than a multiple of the threads: each context is cut into ranges of whole
    blocks, merged after; q is a strided view into a fused qkv projection, as the engine passes it."""
    g = torch.Generator().manual_seed(sum(lens))
    block_size, head_dim = 16, 64
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lens), num_blocks), -1, dtype=torch.int32)
    for row, n in enumerate(lens):
        for i in range(-(-n // block_size)):
            tables[row, i] = order.pop()
    qkv = torch.randn(len(lens), num_heads + 2 * num_kv_heads, head_dim, generator=g) * 4  # peaked softmax
    q, context_lens, scale = qkv[:, :num_heads], torch.tensor(lens, dtype=torch.int32), head_dim**-0.5
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
    finally:
        torch.set_num_threads(threads)
    want = reference.paged_decode_attention(q.contiguous(), k_cache, v_cache, tables, context_lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all((got[row] == 0).all() for row, n in enumerate(lens) if n == 0)


def test_fused_elementwise_kernels_equal_the_torch_layer_code():
    from tokenweir.engine.model.llama import apply_rope, rms_norm

    ops = load()
    g = torch.Generator().manual_seed(5)
    x, weight = torch.randn(7, 576, generator=g), torch.randn(576, generator=g)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-6)

    heads, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(7, (heads + 2 * kv_heads) * head_dim, generator=g)
    cos, sin = torch.randn(7, head_dim, generator=g), torch.randn(7, head_dim, generator=g)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q = apply_rope(q.reshape(7, heads, head_dim), cos, sin)
    want_k = apply_rope(k.reshape(7, kv_heads, head_dim), cos, sin)
    want_v = v.clone()
    ops.rope_(qkv, cos, sin, heads + kv_heads, head_dim)
    torch.testing.assert_close(q.reshape(7, heads, head_dim), want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k.reshape(7, kv_heads, head_dim), want_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(v, want_v)  # values are not rotated

    gate_up = torch.randn(7, 2 * 1536, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("intermediate", [1536, 37])  # whole vectors; a scalar tail after two of them
def test_silu_mul_over_the_whole_range_of_gates(intermediate):
    """The vector sigmoid takes e^-|x| either side of 0: large gates of both signs, zeros and tiny values included."""
    g = torch.Generator().manual_seed(intermediate)
    gate = torch.randn(64, intermediate, generator=g) * 8
    gate[0, :12] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 80.0, -80.0, 0.5, -0.5, 3.0, -3.0])
    up = torch.randn(64, intermediate, generator=g)
    got = load().silu_mul(torch.cat([gate, up], dim=1))
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-30)
