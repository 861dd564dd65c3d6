// y[M, N] = x[M, K] . W[N, K]^T for W in the GGUF's own Q4_1 blocks, with the activations rounded to Q8_1 as
// llama.cpp does at decode (quantize_row_q8_1 + ggml_vec_dot_q4_1_q8_1). A Q4_1 block of 32 weights is
// w = d * q + m with q in 0..15; a Q8_1 block of 32 activations is x = dx * qx with qx in -127..127 and its sum
// s = dx * sum(qx). So a block's dot is d * dx * sum(q * qx) + m * s: the first sum in integers, the m term a float
// product per block.
//
// Why: a batch-1 decode step reads every weight once from memory; Q4_1 is 20 bytes per 32 weights, int8 + float32
// scales 36. The activation scales stay float32 where llama.cpp rounds them to float16 (a closer result, same maths).
//
// planes = 2 keeps the activations' rounding error too: a second int8 plane rounds x - dx * q1 in steps of dx / 254,
// so x ~ (dx / 254) * (254 * q1 + q2), about 15 bits where Q8_1 has 8, and s is the block's exact float sum. Each
// weight vector then takes two maddubs; a decode step, bound by reading the weights, hardly notices.
//
// Weight layout (pack_q4_1 in engine/model/gguf_blocks.py makes it from the GGUF's blocks), per row of B = K / 32 blocks:
//   [B * 16 nibble bytes][B float16 d][B float16 m]
// One row is one stream (the prefetcher follows one stream best), 20 bytes a block as in the file. The nibble bytes
// of every full group of 8 blocks are interleaved by 4-byte words: word (t, j), at (t * 8 + j) * 4, holds bytes
// 4t..4t+3 of block j (byte k holds the block's weights k and k + 16 in its low and high nibble, as in the GGUF).
// Then 32-bit lane j of every vector belongs to block j: _mm256_maddubs_epi16 (nibbles unsigned, activations
// signed) and one _mm256_madd_epi16 leave the eight blocks' integer dots in the eight lanes, which are scaled by eight
// blocks' d * dx in one multiply, with no per-block broadcast or horizontal sum. The activations are quantized into
// the same order. The trailing B % 8 blocks keep the GGUF's order.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "q4_1_layout.h"

// Activation rows multiplied per pass over a weight row. Each row keeps two accumulators beside the group's eight
// weight vectors: AVX2's 16 vector registers hold three rows (a fourth spilled, and cost 2.5x a third), AVX-512's 32
// hold eight.
#if defined(__AVX512F__)
static constexpr int TILE_M = 8;
#else
static constexpr int TILE_M = 3;
#endif

// Where activation k of a row goes in the quantized row: inside a full group, word w of block j (values 4w..4w+3)
// sits in vector 2 * (w % 4) + w / 4 (low nibbles of word t = w, then high nibbles), lane j.
static inline int64_t packed_word(int64_t block, int64_t word, int64_t full_groups) {
  const int64_t g = block / GROUP, j = block % GROUP;
  if (g >= full_groups) return block * 8 + word;
  return g * GROUP * 8 + (2 * (word % 4) + word / 4) * 8 + j;
}

static inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd.h"

static inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// The 32 int32 values of four vectors -> int8 words in the row's order (the packs work per 128-bit lane: the
// permute puts the 32 bytes back in order).
static inline void store_block(const __m256i* i32, int64_t b, int64_t full, int32_t* words) {
  const __m256i p8 = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  alignas(32) int32_t block[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(block), p8);
  for (int w = 0; w < 8; ++w) words[packed_word(b, w, full)] = block[w];
}

// Rows of P planes of K int8 each; d: the unit of a block's integer (254 * q1 + q2 with two planes), s: its sum.
template <int P>
static void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t B = K / QK, full = B / GROUP;
  int32_t* words = reinterpret_cast<int32_t*>(q);
  for (int64_t b = 0; b < B; ++b, x += QK) {
    __m256 v[4];
    const float m = load_block_absmax(x, v);
    const float dx = m / 127.f;
    const __m256 id = _mm256_set1_ps(m != 0.f ? 127.f / m : 0.f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) i32[i] = round_to_i32(_mm256_mul_ps(v[i], id));
    store_block(i32, b, full, words);
    if constexpr (P == 1) {
      const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
      const int32_t sum = hsum_i32(sums);
      d[b] = dx;
      s[b] = dx * static_cast<float>(sum);
    } else {
      __m256i j32[4];
      round_second_plane(v, i32, dx, m != 0.f, j32);
      store_block(j32, b, full, words + K / 4);
      d[b] = dx / 254.f;
      s[b] = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    }
  }
}

// One weight row against MT activation rows. Per full group: 4 loads of 32 nibble bytes give 8 vectors of 0..15
// values; each row's 8 vectors of products leave one integer dot per block in the block's 32-bit lane. With VNNI
// (AVX512-VNNI + VL, or AVX-VNNI) one vpdpbusd multiplies 32 pairs and adds them into the lanes; without it, 8 maddubs
// are summed in int16 (16 products of at most 15 * 127 per lane: < 2^15) and widened once. Both are exact, so the two
// paths give the same sums. Two accumulators per row (dots, m terms) keep two FMA chains in flight.
// Eight blocks' dots from maddubs' int16 sums, one plane's or two planes' (first plane in units of 254).
template <int P>
static inline __m256i block_dots(__m256i s16, __m256i t16) {
  if constexpr (P == 1) return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
  return _mm256_add_epi32(_mm256_madd_epi16(s16, _mm256_set1_epi16(254)), _mm256_madd_epi16(t16, _mm256_set1_epi16(1)));
}

template <int P>
static inline __m256i group_dots(const __m256i wv[8], const __m256i* xv, int64_t K) {
#if defined(TOKENWEIR_VNNI)
  const auto plane = [&](const __m256i* x) {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();  // two chains: vpdpbusd's latency
    for (int i = 0; i < 8; i += 2) {
      a = dot_u8_i8(a, wv[i], _mm256_loadu_si256(x + i));
      b = dot_u8_i8(b, wv[i + 1], _mm256_loadu_si256(x + i + 1));
    }
    return _mm256_add_epi32(a, b);
  };
  if constexpr (P == 1) return plane(xv);
  return _mm256_add_epi32(_mm256_mullo_epi32(plane(xv), _mm256_set1_epi32(254)), plane(xv + K / 32));
#else
  const auto plane = [&](const __m256i* x) {
    __m256i s16 = _mm256_maddubs_epi16(wv[0], _mm256_loadu_si256(x));
    for (int i = 1; i < 8; ++i) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wv[i], _mm256_loadu_si256(x + i)));
    return s16;
  };
  const __m256i s16 = plane(xv);
  return block_dots<P>(s16, P == 2 ? plane(xv + K / 32) : s16);
#endif
}

template <int MT, int P>
static inline void row_dot(const uint8_t* w, int64_t B, const int8_t* xq, const float* xd, const float* xs, int64_t K,
                           float* y, int64_t N) {
  const int64_t full = B / GROUP;
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(w + B * NIBBLES);
  const uint16_t* wm = wd + B;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MT], macc[MT];
  float tail[MT];
  for (int r = 0; r < MT; ++r) acc[r] = macc[r] = _mm256_setzero_ps(), tail[r] = 0.f;
  for (int64_t g = 0; g < full; ++g) {
    __m256i wv[8];
    for (int t = 0; t < 4; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * GROUP * NIBBLES + 32 * t));
      wv[2 * t] = _mm256_and_si256(v, low);
      wv[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + g * GROUP)));
    const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + g * GROUP)));
    for (int r = 0; r < MT; ++r) {
      const __m256i* xv = reinterpret_cast<const __m256i*>(xq + r * P * K + g * GROUP * QK);
      const __m256 dot = _mm256_cvtepi32_ps(group_dots<P>(wv, xv, K));
      const __m256 scale = _mm256_mul_ps(d8, _mm256_loadu_ps(xd + r * B + g * GROUP));
      acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
      macc[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xs + r * B + g * GROUP), macc[r]);
    }
  }
  for (int64_t b = full * GROUP; b < B; ++b) {  // GGUF order: the low nibbles are values 0..15, the high 16..31
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * NIBBLES));
    const __m256i wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
    const float d = _cvtsh_ss(wd[b]), m = _cvtsh_ss(wm[b]);
    for (int r = 0; r < MT; ++r) {
      const int8_t* xr = xq + r * P * K + b * QK;
      const __m256i s16 = _mm256_maddubs_epi16(wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr)));
      const __m256i t16 =
          P == 2 ? _mm256_maddubs_epi16(wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + K))) : s16;
      const __m256 dot = _mm256_cvtepi32_ps(block_dots<P>(s16, t16));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * xd[r * B + b]), acc[r]);
      tail[r] = std::fma(m, xs[r * B + b], tail[r]);  // explicit: contraction must not depend on MT
    }
  }
  for (int r = 0; r < MT; ++r) y[r * N] = hsum(_mm256_add_ps(acc[r], macc[r])) + tail[r];
}

// Weights are streamed from memory once per call, and the hardware prefetcher alone falls behind at every row count
// measured (1 to 16), so the kernel asks for the rows a few ahead itself (as q8_linear).
static inline void prefetch_row(const uint8_t* w, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(w + b), _MM_HINT_T0);
}
#else
template <int P>
static void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t B = K / QK, full = B / GROUP;
  int32_t* words = reinterpret_cast<int32_t*>(q);
  for (int64_t b = 0; b < B; ++b, x += QK) {
    float m = 0.f;
    for (int i = 0; i < QK; ++i) m = std::max(m, std::fabs(x[i]));
    const float dx = m / 127.f, id = m != 0.f ? 127.f / m : 0.f, id2 = m != 0.f ? 254.f / dx : 0.f;
    int8_t block[QK], block2[QK];
    int32_t sum = 0;
    float exact = 0.f;
    for (int i = 0; i < QK; ++i) {
      sum += block[i] = static_cast<int8_t>(std::nearbyint(x[i] * id));  // default mode: to even
      block2[i] = static_cast<int8_t>(std::nearbyint(std::fma(-static_cast<float>(block[i]), dx, x[i]) * id2));
      exact += x[i];
    }
    d[b] = P == 1 ? dx : dx / 254.f;
    s[b] = P == 1 ? dx * static_cast<float>(sum) : exact;
    for (int w = 0; w < 8; ++w) std::memcpy(words + packed_word(b, w, full), block + 4 * w, 4);
    if (P == 2)
      for (int w = 0; w < 8; ++w) std::memcpy(words + K / 4 + packed_word(b, w, full), block2 + 4 * w, 4);
  }
}

template <int MT, int P>
static inline void row_dot(const uint8_t* w, int64_t B, const int8_t* xq, const float* xd, const float* xs, int64_t K,
                           float* y, int64_t N) {
  const int64_t full = B / GROUP;
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(w + B * NIBBLES);
  const uint16_t* wm = wd + B;
  for (int r = 0; r < MT; ++r) {
    float sum = 0.f;
    for (int64_t b = 0; b < B; ++b) {
      int32_t dot = 0;
      for (int64_t k = 0; k < NIBBLES; ++k) {  // byte k of the block holds values k and k + 16
        const int64_t word = k / 4, byte = k % 4;
        const uint8_t v = w[nibble_byte_at(b, k, B)];
        for (int p = 0; p < P; ++p) {
          const int8_t* xr = xq + r * P * K + p * K;
          const int32_t unit = P == 2 && p == 0 ? 254 : 1;
          dot += unit * (v & 0x0F) * xr[packed_word(b, word, full) * 4 + byte];
          dot += unit * (v >> 4) * xr[packed_word(b, word + 4, full) * 4 + byte];
        }
      }
      sum += half_to_float(wd[b]) * xd[r * B + b] * static_cast<float>(dot) + half_to_float(wm[b]) * xs[r * B + b];
    }
    y[r * N] = sum;
  }
}

static inline void prefetch_row(const uint8_t*, int64_t) {}
#endif

// The last rows (fewer than TILE_M) of a weight row's pass.
template <int R, int P>
static inline void rows_rest(const uint8_t* w, int64_t B, const int8_t* xq, const float* xd, const float* xs,
                             int64_t rows, int64_t K, float* y, int64_t N) {
  if constexpr (R > 0) {
    if (rows == R) return row_dot<R, P>(w, B, xq, xd, xs, K, y, N);
    rows_rest<R - 1, P>(w, B, xq, xd, xs, rows, K, y, N);
  }
}

template <int P>
static inline void rows_tile(const uint8_t* w, int64_t B, const int8_t* xq, const float* xd, const float* xs,
                             int64_t M, int64_t K, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + TILE_M <= M; m += TILE_M)
    row_dot<TILE_M, P>(w, B, xq + m * P * K, xd + m * B, xs + m * B, K, y + m * N, N);
  rows_rest<TILE_M - 1, P>(w, B, xq + m * P * K, xd + m * B, xs + m * B, M - m, K, y + m * N, N);
}

template <int P>
static torch::Tensor linear(torch::Tensor x, torch::Tensor w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), B = K / QK;
  auto xc = x.contiguous();
  // Plain buffers, not tensors: a decode step makes ~120 of these calls.
  std::vector<int8_t> xq(M * P * K);
  std::vector<float> xd(M * B), xs(M * B);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row<P>(xc.data_ptr<float>() + m * K, K, xq.data() + m * P * K, xd.data() + m * B, xs.data() + m * B);
  });
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = B * ROW_BYTES_PER_BLOCK;
  constexpr int64_t AHEAD = 8;  // rows
  constexpr int64_t TILE_N = 16;  // weight rows whose nibbles (with a TILE_M-row activation tile) stay in L1
  // Up to 16 rows (decode batches, speculative verification) the activations stay in L2 while each weight row passes
  // once.
  constexpr int64_t DECODE_M = 16;
  at::parallel_for(0, N, TILE_N, [&](int64_t n0, int64_t n1) {
    if (M <= DECODE_M) {  // one pass over the weights
      for (int64_t n = n0; n < n1; ++n) {
        if (n + AHEAD < n1) prefetch_row(wp + (n + AHEAD) * row_bytes, row_bytes);
        rows_tile<P>(wp + n * row_bytes, B, xq.data(), xd.data(), xs.data(), M, K, yp + n, N);
      }
      return;
    }
    // Prefill chunks: every 4-row activation tile meets TILE_N weight rows while both are in L1, instead of one
    // weight row streaming all M activation rows (up to 1.5 MiB with two planes) through the caches.
    for (int64_t nt = n0; nt < n1; nt += TILE_N) {
      const int64_t nend = std::min(nt + TILE_N, n1);
      for (int64_t m = 0; m < M; m += TILE_M) {
        const int64_t rows = std::min<int64_t>(TILE_M, M - m);
        for (int64_t n = nt; n < nend; ++n)
          rows_tile<P>(wp + n * row_bytes, B, xq.data() + m * P * K, xd.data() + m * B, xs.data() + m * B, rows, K,
                       yp + m * N + n, N);
      }
    }
  });
  return y;
}

// planes: 1 = activations rounded to Q8_1 (llama.cpp), 2 = two int8 planes (see the top).
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor w, int64_t planes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "float32 x [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "uint8 packed Q4_1 rows [N, *]");
  const int64_t K = x.size(1), B = K / QK;
  TORCH_CHECK(K % QK == 0 && w.size(1) == B * ROW_BYTES_PER_BLOCK, "K a multiple of 32, rows of K / 32 * 20 bytes");
  TORCH_CHECK(planes == 1 || planes == 2, "planes: 1 or 2");
  return planes == 1 ? linear<1>(x, w) : linear<2>(x, w);
}

// Packed rows [N, K / 32 * 20] -> [N, K] float32 or bfloat16 (rounded to nearest even): d * q + m, for the prefill
// path's dense GEMM and the tests. Written in the GEMM's dtype directly: a float32 copy then narrowed would write the
// matrix twice.
template <typename T>
static void dequantize_rows(const uint8_t* wp, int64_t N, int64_t K, T* op) {
  const int64_t B = K / QK;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = wp + n * B * ROW_BYTES_PER_BLOCK;
      const uint16_t* wd = reinterpret_cast<const uint16_t*>(row + B * NIBBLES);
      const uint16_t* wm = wd + B;
      for (int64_t b = 0; b < B; ++b) {
        const float d = half_to_float(wd[b]), m = half_to_float(wm[b]);
        float block[QK];
        for (int64_t k = 0; k < NIBBLES; ++k) {
          const uint8_t v = row[nibble_byte_at(b, k, B)];
          block[k] = d * static_cast<float>(v & 0x0F) + m;
          block[k + 16] = d * static_cast<float>(v >> 4) + m;
        }
        T* o = op + n * K + b * QK;
        if constexpr (std::is_same_v<T, float>) {
          std::memcpy(o, block, sizeof(block));
        } else {  // round to nearest even on the bits (weights are finite), a loop the compiler vectorizes
          uint32_t bits[QK];
          std::memcpy(bits, block, sizeof(block));
          uint16_t* out = reinterpret_cast<uint16_t*>(o);
          for (int64_t k = 0; k < QK; ++k) out[k] = static_cast<uint16_t>((bits[k] + 0x7FFF + ((bits[k] >> 16) & 1)) >> 16);
        }
      }
    }
  });
}

torch::Tensor q4_1_dequantize(torch::Tensor w, int64_t K, bool bf16) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "uint8 packed Q4_1 rows [N, *]");
  const int64_t N = w.size(0), B = K / QK;
  TORCH_CHECK(K % QK == 0 && w.size(1) == B * ROW_BYTES_PER_BLOCK, "K a multiple of 32, rows of K / 32 * 20 bytes");
  auto out = torch::empty({N, K}, w.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
  if (bf16)
    dequantize_rows(w.data_ptr<uint8_t>(), N, K, reinterpret_cast<c10::BFloat16*>(out.data_ptr()));
  else
    dequantize_rows(w.data_ptr<uint8_t>(), N, K, out.data_ptr<float>());
  return out;
}
