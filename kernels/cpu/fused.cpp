// Element-wise steps of a decoder layer fused into one pass each, for float32 on CPU: in a batch-1 decode step each
// of them is a handful of tiny torch ops whose dispatch (~5 us each, ~1000 per step) cost more than the arithmetic.
// Same formulas as HF's Llama (float32): RMSNorm, rotate-half RoPE, SiLU(gate) * up.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#if defined(__AVX512F__)
#include "exp512.h"
#endif

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32, "float32");
  auto xc = x.contiguous();
  const int64_t H = xc.size(-1), T = xc.numel() / H;
  TORCH_CHECK(weight.numel() == H, "weight [H]");
  auto y = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += row[i] * row[i];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      float* out = yp + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) out[i] = wp[i] * (row[i] * r);
    }
  });
  return y;
}

// In place on the first `heads` heads of each row of qkv [T, >= heads * D] (q then k): x*cos + rotate_half(x)*sin.
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32 && qkv.stride(1) == 1, "float32 rows");
  auto cc = cos.contiguous();
  auto sc = sin.contiguous();
  const int64_t T = qkv.size(0), row_stride = qkv.stride(0), half = head_dim / 2;
  TORCH_CHECK(cc.size(0) == T && cc.size(1) == head_dim, "cos/sin [T, D]");
  float* p = qkv.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * head_dim;
      const float* s = sp + t * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = p + t * row_stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] + (-x2) * s[i];
          x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat32, "float32");
  auto gc = gate_up.contiguous();
  const int64_t T = gc.size(0), I = gc.size(1) / 2;
  auto y = torch::empty({T, I}, gc.options());
  const float* gp = gc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* out = yp + t * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      // A vector e^x instead of std::exp, one value at a time: a prefill chunk's SiLU was 11% of its step. The
      // sigmoid from e = e^-|x| (never overflows): 1 / (1 + e) for x >= 0, e / (1 + e) below.
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= I; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
        const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
        const __m512 sigmoid = _mm512_mask_mul_ps(inv, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), e, inv);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(x, sigmoid), _mm512_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}
