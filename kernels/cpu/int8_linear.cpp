// y[M, N] = x[M, K] (float32) . dequant(w)^T, w[N, K] int8 with one float32 scale per group of G consecutive
// weights of a row (scales [N, K / G]), for the small M of decode steps.
//
// Weight-only int8: each weight row is read once per call (a quarter of float32's bytes, which is what bounds a
// decode step on CPU), widened and scaled to float32 in registers and multiplied against up to four activation rows
// at a time. Activations stay float32, so the only error is the weights' own rounding. AVX2 + FMA; any other CPU takes
// the scalar loop. Parallel over output channels.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"

template <int MT>
static inline void rows_dot(const float* x, int64_t K, const int8_t* w, const float* scale, int64_t G, float* y,
                            int64_t N) {
  // U independent accumulators per row hide the FMA latency when few rows share a weight vector; U does not depend
  // on MT, so a row comes out bit for bit the same whether it runs alone or in a tile (speculative decoding checks
  // drafts as extra rows and must get plain decoding's logits).
  constexpr int U = 2;  // the same for every MT: a row sums in one order whatever shares its tile
  __m256 acc[U][MT];
  float tail[MT] = {};
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < MT; ++r) acc[u][r] = _mm256_setzero_ps();
  // One group of G weights shares a scale: widened weights are scaled once and reused by every row.
  for (int64_t g0 = 0, group = 0; g0 < K; g0 += G, ++group) {
    const __m256 sv = _mm256_set1_ps(scale[group]);
    int64_t k = g0;
    for (; k + 8 * U <= g0 + G; k += 8 * U) {
      for (int u = 0; u < U; ++u) {
        const __m128i w8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k + 8 * u));
        const __m256 wv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w8)), sv);
        for (int r = 0; r < MT; ++r) acc[u][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8 * u), wv, acc[u][r]);
      }
    }
    for (; k + 8 <= g0 + G; k += 8) {
      const __m128i w8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k));
      const __m256 wv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w8)), sv);
      for (int r = 0; r < MT; ++r) acc[0][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wv, acc[0][r]);
    }
    for (; k < g0 + G; ++k)  // a group that is not a multiple of 8 wide (a whole odd-sized row)
      for (int r = 0; r < MT; ++r)  // explicit fma: contraction must not depend on MT
        tail[r] = std::fma(x[r * K + k] * static_cast<float>(w[k]), scale[group], tail[r]);
  }
  for (int r = 0; r < MT; ++r) {
    for (int u = 1; u < U; ++u) acc[0][r] = _mm256_add_ps(acc[0][r], acc[u][r]);
    y[r * N] = hsum(acc[0][r]) + tail[r];
  }
}
#else
template <int MT>
static inline void rows_dot(const float* x, int64_t K, const int8_t* w, const float* scale, int64_t G, float* y, int64_t N) {
  for (int r = 0; r < MT; ++r) {
    float s = 0.f;
    for (int64_t j = 0; j < K; ++j) s += x[r * K + j] * static_cast<float>(w[j]) * scale[j / G];
    y[r * N] = s;
  }
}
#endif

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kInt8, "float32 x, int8 w");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.dim() == 2 && scales.size(0) == w.size(0),
              "float32 scales [N, groups]");
  TORCH_CHECK(w.is_contiguous() && scales.is_contiguous(), "contiguous weights");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0), groups = scales.size(1);
  TORCH_CHECK(K % groups == 0, "groups divide K");
  const int64_t G = K / groups;
  auto y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = wp + n * K;  // one weight row, reused from L1 by every tile of activation rows
      const float* sr = sp + n * groups;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) rows_dot<4>(xp + m * K, K, wr, sr, G, yp + m * N + n, N);
      switch (M - m) {
        case 3: rows_dot<3>(xp + m * K, K, wr, sr, G, yp + m * N + n, N); break;
        case 2: rows_dot<2>(xp + m * K, K, wr, sr, G, yp + m * N + n, N); break;
        case 1: rows_dot<1>(xp + m * K, K, wr, sr, G, yp + m * N + n, N); break;
        default: break;
      }
    }
  });
  return y;
}
