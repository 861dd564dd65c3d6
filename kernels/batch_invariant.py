"""Triton matmul and RMSNorm whose result for a row does not depend on the other rows of the call (CUDA).

cuBLAS picks its GEMM kernel (tile shape, split-K) by the problem's shape, and torch's row reductions pick how many
threads share a row by the number of rows, so on a GPU a token's logits move in the last bits with the batch it
runs in. Speculative decoding checks drafts as extra rows of a step, so such a drift turns a near tie into another
token than plain decoding's. Here every tile shape is fixed whatever M is, K is summed in one order (no split-K) and a
row is normalised by one program alone: a row comes out bit for bit the same in any batch (as the batch-invariant
kernels vLLM runs under VLLM_BATCH_INVARIANT). The price is cuBLAS's shape-tuned speed.
Under TRITON_INTERPRET=1 the same code runs on CPU tensors (float32), which is how the tests run it here.
"""

import torch
import triton
import triton.language as tl

from tokenweir.kernels.attention.triton_paged import _check_device

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64


# M is not specialised: Triton would otherwise compile another kernel for M == 1 (or M % 16 == 0), and the
# point is that every M runs the same code.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K,
    stride_xm, stride_wk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    r_mask = rows < M
    c_mask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_mask = k < K
        x_tile = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + k[None, :]
        w_tile = w_ptr + k.to(tl.int64)[:, None] * stride_wk + cols[None, :]
        x = tl.load(x_tile, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_tile, mask=k_mask[:, None] & c_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & c_mask[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [K, N] (the weight pre-transposed, as DenseLinear keeps it), fp32 accumulation."""
    m, k = x.shape
    assert weight.shape[0] == k and weight.dtype == x.dtype, "x [M, K] and weight [K, N] of one dtype"
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    _check_device(x, weight)
    if x.stride(1) != 1:
        x = x.contiguous()
    n = weight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    scale = tl.math.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask)
    # the rounding order of engine.model.llama.rms_norm: normalise in float32, round to x's dtype, then scale
    tl.store(out_ptr + row * stride_o + cols, w * (xf * scale).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] normalised row by row, one program a row, times weight [H]."""
    assert x.dim() == 2 and weight.shape == (x.shape[1],), "x [T, H], weight [H]"
    _check_device(x, weight)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, weight, out, x.stride(0), out.stride(0), x.shape[1], eps, BLOCK=triton.next_power_of_2(x.shape[1])
        )
    return out
