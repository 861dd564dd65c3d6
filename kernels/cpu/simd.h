// AVX2 pieces the integer GEMMs share (int8_linear.cpp, q8_linear.cpp, q4_linear.cpp): a horizontal sum, llama.cpp's
// rounding of 32 activations to int8 (quantize_row_q8_0 / q8_1: scale amax / 127, round to nearest, ties to even), and
// the second plane that keeps that rounding's error. Included inside each file's AVX2 section.
#pragma once
#include <immintrin.h>

// u8 x s8 products, 4 per 32-bit lane, added into the lane: one instruction with VNNI (AVX512-VNNI with VL on
// AMD Zen 4 and Intel server cores, AVX-VNNI on Intel client cores), where maddubs + madd take two and saturate.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TOKENWEIR_VNNI 1
static inline __m256i dot_u8_i8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define TOKENWEIR_VNNI 1
static inline __m256i dot_u8_i8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline __m256i round_to_i32(__m256 v) {  // to nearest, ties to even
  return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Loads 32 floats into v and returns their largest magnitude.
static inline float load_block_absmax(const float* x, __m256 v[4]) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

// The second plane of a block rounded with unit dx: x - dx * q1 in steps of dx / 254. |x - dx * q1| <= dx / 2, so it
// stays within -127..127 (the sign trick of the dot products holds).
// `live`: the block's amax is not 0.
static inline void round_second_plane(const __m256 v[4], const __m256i q1[4], float dx, bool live, __m256i q2[4]) {
  const __m256 dv = _mm256_set1_ps(dx), id2 = _mm256_set1_ps(live ? 254.f / dx : 0.f);
  for (int i = 0; i < 4; ++i)
    q2[i] = round_to_i32(_mm256_mul_ps(_mm256_fnmadd_ps(_mm256_cvtepi32_ps(q1[i]), dv, v[i]), id2));
}
