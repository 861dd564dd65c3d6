"""Activations in two int8 planes (planes=2 of q4_1_linear and q8_linear, `--quantization gguf-a16`): the second
plane rounds what the first left, x - d * q1, in steps of d / 254, and both kernels equal a torch reference of that
maths (integer dots 254 * sum(w * q1) + sum(w * q2) per block, the block's exact sum for Q4_1's m term) to float
rounding, on the model's shapes and M of 1 to 64; the result is about 100x closer to float32 than one plane's."""

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tokenweir.engine.model.gguf_blocks import pack_q4_1, q4_1_fields
from tokenweir.engine.model.linear import _dequantize, _grouped_int8
from tokenweir.kernels.cpu.ops import q4_1_dequantize, q4_1_linear, q8_linear


def two_planes_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q [M, B, 32] = 254 * q1 + q2 as float64, unit d / 254 [M, B], exact block sums [M, B])."""
    m, k = x.shape
    groups = x.reshape(m, k // 32, 32)
    amax = groups.abs().amax(dim=2)
    d = amax / 127
    inverse = torch.where(amax != 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))
    q1 = (groups * inverse[:, :, None]).round()
    # The kernels take x - q1 * d in one fused multiply-add: float64 holds the product exactly.
    residual = (groups.double() - q1.double() * d.double()[:, :, None]).float()
    inverse2 = torch.where(amax != 0, torch.full_like(d, 254).div(d), torch.zeros_like(d))
    q2 = (residual * inverse2[:, :, None]).round()
    assert q2.abs().max() <= 127
    return 254 * q1.double() + q2.double(), (d / 254).double(), groups.double().sum(2)


def random_q4_1(n: int, k: int, seed: int) -> torch.Tensor:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return torch.from_numpy(quantize(weight.numpy(), GGMLQuantizationType.Q4_1))


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, 5] = 40.0  # an outlier: one plane loses its block's small values, two keep them
    x[-1, 32:64] = 0  # an all-zero block
    return x


SHAPES = [(576, 960), (576, 3072), (1536, 576), (608, 37), (96, 40)]  # (K, N): the model's, a tail, tail only


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_q4_1_kernel_equals_the_two_plane_maths(k, n, m):
    data = random_q4_1(n, k, seed=k + n)
    x = activations(m, k, seed=m)
    nibbles, d, mins = q4_1_fields(data)
    w = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).double()
    xq, unit, sums = two_planes_reference(x)
    scaled = torch.einsum("mbk,nbk->mnb", xq, w) * (d.double()[None] * unit[:, None])
    offsets = mins.double()[None] * sums[:, None]
    want, magnitude = (scaled + offsets).sum(2), (scaled.abs() + offsets.abs()).sum(2)
    error = (q4_1_linear(x, pack_q4_1(data), 2).double() - want).abs()
    assert (error <= 1e-5 * magnitude + 1e-12).all(), error.max()


@pytest.mark.parametrize("k,n", SHAPES[:3] + [(576, 49152)])
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_q8_kernel_equals_the_two_plane_maths(k, n, m):
    q, scales = _grouped_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)) * 0.05)
    x = activations(m, k, seed=m)
    xq, unit, _ = two_planes_reference(x)
    dots = torch.einsum("mbk,nbk->mnb", xq, q.reshape(n, -1, 32).double())
    terms = dots * (scales.double()[None] * unit[:, None])
    error = (q8_linear(x, q, scales, 2).double() - terms.sum(2)).abs()
    assert (error <= 1e-5 * terms.abs().sum(2) + 1e-12).all(), error.max()


def test_two_planes_are_about_100x_closer_to_float32_than_one():
    data = random_q4_1(1536, 576, seed=5)
    packed, x = pack_q4_1(data), activations(16, 576, seed=6)
    exact = x.double() @ q4_1_dequantize(packed, 576).double().t()
    one, two = ((q4_1_linear(x, packed, p).double() - exact).norm() / exact.norm() for p in (1, 2))
    assert two < one / 50 and two < 1e-4
    q, scales = _grouped_int8(torch.randn(1536, 576) * 0.05)
    exact = x.double() @ _dequantize(q, scales).double().t()
    one, two = ((q8_linear(x, q, scales, p).double() - exact).norm() / exact.norm() for p in (1, 2))
    assert two < one / 50 and two < 1e-4


def test_planes_other_than_one_or_two_are_refused():
    with pytest.raises(RuntimeError, match="planes"):
        q4_1_linear(torch.randn(1, 64), pack_q4_1(random_q4_1(4, 64, seed=1)), 3)
    q, scales = _grouped_int8(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match="planes"):
        q8_linear(torch.randn(1, 64), q, scales, 0)
