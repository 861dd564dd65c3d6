// y[M, N] = x[M, K] . dequant(w)^T with the activations quantized too, as llama.cpp does at decode: each row of x is
// cut into groups of 32, each group rounded to int8 with one float scale (quantize_row_q8_0: d = amax / 127, q =
// round-to-nearest-even(x * 127 / amax)), and every group's dot product with the int8 weights (one float scale per 32
// weights of a row, scales [N, K / 32]) is done in integers, then scaled by the two groups' scales
// (ggml_vec_dot_q8_0_q8_0). The scales stay float32 where llama.cpp rounds them to float16.
//
// Why: widening int8 weights to float32 costs four converts and a multiply per 8 weights, which made the weight-only
// kernel compute-bound; here one _mm256_maddubs_epi16 multiplies 32 pairs. maddubs takes one unsigned operand, so the
// sign trick feeds it |w| and x with w's sign (the same products); |w| is then shared by every activation row of a
// tile. Pairs sum to at most 2 * 127 * 127, inside int16. AVX2; any other CPU takes the scalar loop.
//
// planes = 2 keeps the activations' rounding error too, as q4_linear.cpp does: a second int8 plane rounds
// x - d * q1 in steps of d / 254, so x ~ (d / 254) * (254 * q1 + q2), about 15 bits where Q8_0 has 8.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

static constexpr int64_t QK = 32;  // weights and activations per scale

#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"

static inline void store_block(const __m256i* i32, int8_t* q) {
  // The packs work per 128-bit lane: the permute puts the 32 bytes back in order.
  const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]);
  const __m256i p16b = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// Rows of P planes of K int8 each; d: the unit of a group's integer (254 * q1 + q2 with two planes).
template <int P>
static void quantize_row(const float* x, int64_t K, int8_t* q, float* d) {
  for (int64_t g = 0; g < K / QK; ++g, x += QK, q += QK) {
    __m256 v[4];
    const float m = load_block_absmax(x, v);
    const float dx = m / 127.f;
    d[g] = P == 1 ? dx : dx / 254.f;
    const __m256 id = _mm256_set1_ps(m != 0.f ? 127.f / m : 0.f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) i32[i] = round_to_i32(_mm256_mul_ps(v[i], id));
    store_block(i32, q);
    if constexpr (P == 2) {
      __m256i j32[4];
      round_second_plane(v, i32, dx, m != 0.f, j32);
      store_block(j32, q + K);
    }
  }
}

// A group's integer dot: one plane's products, or two planes' (254 * p1 + p2). Pairs of products fit int16.
template <int P>
static inline __m256i group_dot(__m256i wa, __m256i wv, const int8_t* x, int64_t K) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i p1 = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(x1, wv));
  if constexpr (P == 1) return _mm256_madd_epi16(p1, ones);
  const __m256i x2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + K));
  const __m256i p2 = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(x2, wv));
  return _mm256_add_epi32(_mm256_madd_epi16(p1, _mm256_set1_epi16(254)), _mm256_madd_epi16(p2, ones));
}

// One weight row against MT activation rows: each group of 32 weights is loaded once per tile and its |w| shared by
// the rows. Each row alternates two accumulators, so the FMA latency does not serialise the groups; the same two
// whatever MT, so a row comes out bit for bit the same alone or in a tile (speculative decoding checks drafts as
// extra rows and must get plain decoding's logits).
template <int MT, int P>
static inline void tile_dot(const int8_t* w, const float* wd, const int8_t* xq, const float* xd, int64_t K, float* y,
                            int64_t N) {
  constexpr int U = 2;
  const int64_t groups = K / QK;
  __m256 acc[U][MT];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < MT; ++r) acc[u][r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + U <= groups; g += U) {
    for (int u = 0; u < U; ++u) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g + u) * QK));
      const __m256i wa = _mm256_sign_epi8(wv, wv);
      for (int r = 0; r < MT; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(group_dot<P>(wa, wv, xq + r * P * K + (g + u) * QK, K));
        acc[u][r] = _mm256_fmadd_ps(_mm256_set1_ps(wd[g + u] * xd[r * groups + g + u]), dot, acc[u][r]);
      }
    }
  }
  for (; g < groups; ++g) {  // an odd group count with two accumulators
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * QK));
    const __m256i wa = _mm256_sign_epi8(wv, wv);
    for (int r = 0; r < MT; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(group_dot<P>(wa, wv, xq + r * P * K + g * QK, K));
      acc[0][r] = _mm256_fmadd_ps(_mm256_set1_ps(wd[g] * xd[r * groups + g]), dot, acc[0][r]);
    }
  }
  for (int r = 0; r < MT; ++r) {
    for (int u = 1; u < U; ++u) acc[0][r] = _mm256_add_ps(acc[0][r], acc[u][r]);
    y[r * N] = hsum(acc[0][r]);
  }
}

// Weights are streamed from memory once per call (a decode step reads ~144 MiB, far more than the caches), and the
// hardware prefetcher alone falls behind at any row count: the kernel asks for the rows a few ahead itself. (Leaving
// it to the hardware from 4 rows up made the tied lm_head's 4-row pass 4x slower than its 3-row one on an Intel Xeon:
// speculative decoding's verification steps.)
static inline void prefetch_row(const int8_t* w, const float* wd, int64_t K) {
  for (int64_t b = 0; b < K; b += 64) _mm_prefetch(reinterpret_cast<const char*>(w + b), _MM_HINT_T0);
  for (int64_t b = 0; b < K / QK * 4; b += 64) _mm_prefetch(reinterpret_cast<const char*>(wd) + b, _MM_HINT_T0);
}
#else
template <int P>
static void quantize_row(const float* x, int64_t K, int8_t* q, float* d) {
  for (int64_t g = 0; g < K / QK; ++g, x += QK, q += QK) {
    float m = 0.f;
    for (int i = 0; i < QK; ++i) m = std::max(m, std::fabs(x[i]));
    const float dx = m / 127.f;
    d[g] = P == 1 ? dx : dx / 254.f;
    const float id = m != 0.f ? 127.f / m : 0.f, id2 = m != 0.f ? 254.f / dx : 0.f;
    for (int i = 0; i < QK; ++i) {
      q[i] = static_cast<int8_t>(std::nearbyint(x[i] * id));  // default mode: to even
      if (P == 2) q[K + i] = static_cast<int8_t>(std::nearbyint(std::fma(-static_cast<float>(q[i]), dx, x[i]) * id2));
    }
  }
}

template <int MT, int P>
static inline void tile_dot(const int8_t* w, const float* wd, const int8_t* xq, const float* xd, int64_t K, float* y,
                            int64_t N) {
  const int64_t groups = K / QK;
  for (int r = 0; r < MT; ++r) {
    float s = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      for (int p = 0; p < P; ++p)
        for (int i = 0; i < QK; ++i)
          dot += (P == 2 && p == 0 ? 254 : 1) * int32_t(w[g * QK + i]) * int32_t(xq[r * P * K + p * K + g * QK + i]);
      s += wd[g] * xd[r * groups + g] * static_cast<float>(dot);
    }
    y[r * N] = s;
  }
}

static inline void prefetch_row(const int8_t*, const float*, int64_t) {}
#endif

template <int P>
static void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row<P>(x + m * K, K, q + m * P * K, d + m * (K / QK));
  });
}

// Rows of x [M, K] float32 -> (int8 [M, K], float32 scales [M, K / 32]): what q8_linear does to its input.
std::tuple<torch::Tensor, torch::Tensor> q8_quantize(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "float32 x [M, K]");
  TORCH_CHECK(x.size(1) % QK == 0, "K a multiple of 32");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto q = torch::empty({M, K}, xc.options().dtype(torch::kInt8));
  auto d = torch::empty({M, K / QK}, xc.options());
  quantize_rows<1>(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>());
  return {q, d};
}

template <int P>
static inline void rows_tile(const int8_t* w, const float* wd, const int8_t* xq, const float* xd, int64_t M, int64_t K,
                             float* y, int64_t N) {
  const int64_t groups = K / QK;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile_dot<4, P>(w, wd, xq + m * P * K, xd + m * groups, K, y + m * N, N);
  switch (M - m) {
    case 3: tile_dot<3, P>(w, wd, xq + m * P * K, xd + m * groups, K, y + m * N, N); break;
    case 2: tile_dot<2, P>(w, wd, xq + m * P * K, xd + m * groups, K, y + m * N, N); break;
    case 1: tile_dot<1, P>(w, wd, xq + m * P * K, xd + m * groups, K, y + m * N, N); break;
    default: break;
  }
}

template <int P>
static torch::Tensor linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), groups = K / QK;
  auto xc = x.contiguous();
  // Plain buffers, not tensors: a decode step makes ~120 of these calls and each tensor costs an allocation's
  // bookkeeping.
  std::vector<int8_t> xq(M * P * K);
  std::vector<float> xd(M * groups);
  quantize_rows<P>(xc.data_ptr<float>(), M, K, xq.data(), xd.data());
  auto y = torch::empty({M, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const int8_t* qp = xq.data();
  const float* dp = xd.data();
  float* yp = y.data_ptr<float>();
  // One weight row at a time: tiles of several weight rows (to share each activation load) read the weights in an
  // order the hardware prefetcher followed worse, and were slower on a decode step's cold weights.
  constexpr int64_t AHEAD = 8;  // rows; measured flat from 4 to 32 on an AVX2 EPYC
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      if (n + AHEAD < n1) prefetch_row(wp + (n + AHEAD) * K, sp + (n + AHEAD) * groups, K);
      rows_tile<P>(wp + n * K, sp + n * groups, qp, dp, M, K, yp + n, N);
    }
  });
  return y;
}

// planes: 1 = activations rounded to int8 per 32 (llama.cpp's Q8_0), 2 = two int8 planes (see the top).
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, int64_t planes) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kInt8, "float32 x, int8 w");
  TORCH_CHECK(w.is_contiguous() && scales.is_contiguous(), "contiguous weights");
  const int64_t K = x.size(1), N = w.size(0), groups = K / QK;
  TORCH_CHECK(K % QK == 0, "K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.dim() == 2 && scales.size(0) == N &&
                  scales.size(1) == groups,
              "float32 scales [N, K / 32]");
  TORCH_CHECK(planes == 1 || planes == 2, "planes: 1 or 2");
  return planes == 1 ? linear<1>(x, w, scales) : linear<2>(x, w, scales);
}
