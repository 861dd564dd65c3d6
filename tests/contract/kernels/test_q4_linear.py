"""The Q4_1 x Q8_1 kernel (kernels/cpu/q4_linear.cpp) against torch: our unpacking of a GGUF's Q4_1 bytes equals
gguf.quants.dequantize; the kernel equals a torch reference of llama.cpp's maths (activations rounded per 32 values
to Q8_1, integer dots with the 4-bit weights, d * dx * dot + m * s per block) to float rounding, on SmolLM2's own
blocks and shapes, for M of 1 to 64 and for K of full interleaved groups, tail blocks or both; the dequantize path
equals the file's weights exactly; Q4Linear's decode and prefill paths agree. The int8 prefill kernel
(kernels/cpu/q4_prefill.cpp) equals the same reference, on the model's blocks and on every panel and tile tail."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from tokenweir.common.text.model_files import default_model_path
from tokenweir.engine.model.gguf_blocks import GGUFBlocks, dequantize_q4_1, pack_q4_1, q4_1_fields, q8_0_fields
from tokenweir.engine.model.linear import DenseLinear, Int8Linear, Q4Linear, make_linear
from tokenweir.kernels.cpu.ops import q4_1_dequantize, q4_1_linear, q4_1_prefill

# (GGUF tensor, K, N): the model's projection shapes; qkv and gate_up are these rows concatenated
MODEL_TENSORS = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.3.ffn_gate.weight", "blk.3.ffn_down.weight"]


@pytest.fixture(scope="module")
def reader() -> GGUFReader:
    return GGUFReader(default_model_path())


def file_blocks(reader: GGUFReader, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor's raw rows uint8 [N, K / 32 * block bytes], gguf's own dequantization float32 [N, K])."""
    tensor = next(t for t in reader.tensors if t.name == name)
    data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
    want = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    return data, torch.from_numpy(want).reshape(data.shape[0], -1)


def random_q4_1(n: int, k: int, seed: int) -> torch.Tensor:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return torch.from_numpy(quantize(weight.numpy(), GGMLQuantizationType.Q4_1))


def q8_1_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's quantize_row_q8_1 in torch, float32 scales: per 32 values d = amax / 127,
    q = round-half-even(x * (127 / amax)), s = d * sum(q). -> (q [M, B, 32], d [M, B], s [M, B])."""
    m, k = x.shape
    groups = x.reshape(m, k // 32, 32)
    amax = groups.abs().amax(dim=2)
    inverse = torch.where(amax != 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))
    q = (groups * inverse[:, :, None]).round()
    d = amax / 127
    return q, d, d * q.sum(2)


def q4_1_linear_reference(x: torch.Tensor, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, the sum of |each block's terms|) in float64 from the integer dots: d * dx * sum(q * qx) + m * s."""
    nibbles, d, m = q4_1_fields(data)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).double()  # [N, B, 32]: values 0..15, then 16..31
    xq, xd, xs = q8_1_reference(x)
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), q)  # exact: integers far below 2^53
    scaled = dots * (d.double()[None] * xd.double()[:, None])
    offsets = m.double()[None] * xs.double()[:, None]
    return (scaled + offsets).sum(2), (scaled.abs() + offsets.abs()).sum(2)


def assert_kernel_matches(x: torch.Tensor, data: torch.Tensor, kernel=q4_1_linear) -> None:
    want, magnitude = q4_1_linear_reference(x, data)
    error = (kernel(x, pack_q4_1(data)).double() - want).abs()
    assert (error <= 1e-5 * magnitude + 1e-12).all(), error.max()


@pytest.mark.parametrize("name", MODEL_TENSORS)
def test_unpacking_the_files_q4_1_bytes_equals_gguf_dequantize(reader, name):
    data, want = file_blocks(reader, name)
    assert torch.equal(dequantize_q4_1(data), want)
    assert torch.equal(q4_1_dequantize(pack_q4_1(data), want.shape[1]), want)


def test_q8_0_fields_are_the_files_values_and_scales(reader):
    data, want = file_blocks(reader, "token_embd.weight")
    q, scales = q8_0_fields(data[:512])
    assert q.dtype == torch.int8 and scales.shape == (512, want.shape[1] // 32)
    assert torch.equal((q.reshape(512, -1, 32).float() * scales[:, :, None]).reshape(512, -1), want[:512])


@pytest.mark.parametrize("name", MODEL_TENSORS)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_kernel_equals_llama_cpp_maths_on_the_models_blocks(reader, name, m):
    data, weight = file_blocks(reader, name)
    x = torch.randn(m, weight.shape[1], generator=torch.Generator().manual_seed(m))
    x[0, 5] = 40.0  # an outlier coarsens its own block only
    assert_kernel_matches(x, data)


# K: 3 blocks (tail only), 8 (one interleaved group), 19 (two groups and a tail); M across the row tiles of 4, and
# (over 4 rows) the prefill order: tiles of 16 weight rows (37 = 16 + 16 + 5) against each 4-row activation tile
@pytest.mark.parametrize("k", [96, 256, 608])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 7, 13, 70])
def test_kernel_equals_llama_cpp_maths_on_every_block_layout(k, m):
    g = torch.Generator().manual_seed(k + m)
    x = torch.randn(m, k, generator=g)
    x[-1, 32:64] = 0  # an all-zero block: scale 0, values 0
    assert_kernel_matches(x, random_q4_1(37, k, seed=k))


@pytest.mark.parametrize("name", MODEL_TENSORS)
def test_prefill_kernel_equals_llama_cpp_maths_on_the_models_blocks(reader, name):
    data, weight = file_blocks(reader, name)
    x = torch.randn(70, weight.shape[1], generator=torch.Generator().manual_seed(7))
    x[0, 5] = 40.0
    assert_kernel_matches(x, data, q4_1_prefill)


# N: 37 leaves a last panel of 5 columns; M across the 4-row tiles and their tails
@pytest.mark.parametrize("k", [96, 256, 608])
@pytest.mark.parametrize("m", [1, 3, 4, 6, 70])
def test_prefill_kernel_equals_llama_cpp_maths_on_every_block_layout(k, m):
    g = torch.Generator().manual_seed(k * m)
    x = torch.randn(m, k, generator=g)
    x[-1, 32:64] = 0
    assert_kernel_matches(x, random_q4_1(37, k, seed=k + 1), q4_1_prefill)


def test_kernel_refuses_k_that_32_does_not_divide_or_rows_of_the_wrong_width():
    packed = pack_q4_1(random_q4_1(8, 64, seed=1))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q4_1_linear(torch.randn(2, 44), packed)
    with pytest.raises(RuntimeError, match="20 bytes"):
        q4_1_linear(torch.randn(2, 96), packed)


@pytest.mark.parametrize("mode,planes,tolerance", [("gguf", 1, 0.01), ("gguf-a16", 2, 1e-4)])
def test_q4linear_answers_the_same_on_the_decode_and_the_prefill_path(reader, mode, planes, tolerance):
    data, weight = file_blocks(reader, "blk.3.ffn_down.weight")
    layer = make_linear(weight, torch.float32, mode, [GGUFBlocks("Q4_1", data)])
    assert isinstance(layer, Q4Linear) and layer.planes == planes and layer.nbytes == data.numel()
    small_m = layer.small_m
    x = torch.randn(small_m + 8, weight.shape[1], generator=torch.Generator().manual_seed(2))
    big = layer(x)  # dequantize + matmul: the file's weights exactly, float32 activations
    torch.testing.assert_close(big, x @ weight.t(), rtol=1e-4, atol=1e-4)
    small = torch.cat([layer(x[:small_m]), layer(x[small_m:])])
    assert ((small - big).norm() / big.norm()).item() < tolerance  # the kernel rounds the activations too


@pytest.mark.parametrize("planes", [1, 2])
def test_int8_prefill_path_takes_chunks_over_small_m_to_the_prefill_kernel(reader, planes):
    data, weight = file_blocks(reader, "blk.3.ffn_down.weight")
    layer = Q4Linear(GGUFBlocks("Q4_1", data), planes=planes, prefill_dtype=torch.int8)
    x = torch.randn(layer.small_m + 5, weight.shape[1], generator=torch.Generator().manual_seed(4))
    big = layer(x)
    torch.testing.assert_close(big, q4_1_linear(x, layer.packed, 1), rtol=1e-5, atol=1e-5)  # one plane's maths
    small = layer(x[:1])
    torch.testing.assert_close(small, q4_1_linear(x[:1], layer.packed, planes), rtol=0, atol=0)


def test_bfloat16_prefill_path_is_the_files_weights_rounded_once(reader):
    data, weight = file_blocks(reader, "blk.3.ffn_down.weight")
    packed = pack_q4_1(data)
    assert torch.equal(q4_1_dequantize(packed, weight.shape[1], torch.bfloat16), weight.bfloat16())  # nearest even
    layer = Q4Linear(GGUFBlocks("Q4_1", data), planes=2, prefill_dtype=torch.bfloat16)
    x = torch.randn(layer.small_m + 1, weight.shape[1], generator=torch.Generator().manual_seed(3))
    want = x.double() @ weight.double().t()
    assert ((layer(x).double() - want).norm() / want.norm()).item() < 1e-2  # bfloat16 activations, weights, output
    assert layer(x[:1]).dtype == layer(x).dtype == torch.float32


def test_gguf_mode_takes_q8_0_as_it_is_and_keeps_other_formats_dense(reader):
    data, weight = file_blocks(reader, "token_embd.weight")
    data, weight = data[:300], weight[:300]
    layer = make_linear(weight, torch.float32, "gguf", [GGUFBlocks("Q8_0", data)])
    assert isinstance(layer, Int8Linear) and layer.int8_activations and layer.planes == 1
    assert make_linear(weight, torch.float32, "gguf-a16", [GGUFBlocks("Q8_0", data)]).planes == 2
    q, scales = q8_0_fields(data)
    assert torch.equal(layer.weight, q) and torch.equal(layer.scales, scales)
    assert isinstance(make_linear(weight, torch.float32, "gguf", [None]), DenseLinear)
    mixed = [GGUFBlocks("Q8_0", data), GGUFBlocks("Q4_1", random_q4_1(4, weight.shape[1], seed=3))]
    assert isinstance(make_linear(torch.cat([weight, weight[:4]]), torch.float32, "gguf", mixed), DenseLinear)
