// Paged prefill attention on CPU: varlen causal chunks q [T, Hq, D] against their paged context (earlier chunks,
// prefix-cached blocks and the chunk itself, already in the cache), flash-style: an online softmax over tiles of 16
// keys, so there is no [q, context] score matrix, no mask tensor, and no key tile past a query tile's last position is
// ever computed (torch's CPU SDPA computes its 512-key tiles whole, half of them masked, in a causal 512-token chunk).
// A task is (sequence, kv head, a few query positions); its rows are those positions times the G query heads sharing
// the kv head, so each key and value serves all of them. Keys are transposed once per (sequence, kv head) into tiles
// [D][16], so a score tile is D broadcast-FMAs per row. float32 throughout; AVX-512, or AVX2 + FMA (a tile's 16
// scores in two vectors), with head_dim 64 (SmolLM2's), where `paged_prefill_attention` returns false otherwise and
// the caller takes the torch reference (also the oracle in tests/contract/kernels/test_cpu_prefill.py).
// With `bf16` (the engine's bfloat16-prefill mode, on a CPU with AVX512_BF16) q.k and p.v are bfloat16 pairs summed
// into float32 by vdpbf16ps, half the instructions of the float32 FMAs: q, k, v and the probabilities are rounded to
// bfloat16 (as flash attention keeps them on GPUs), the softmax and every sum stay float32. Keys are packed per tile as
// [D / 2][16] pairs of dimensions, values as [16 / 2][D] pairs of keys.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define TOKENWEIR_PREFILL_KERNEL 1
#include <immintrin.h>

#if defined(__AVX512F__)
#include "exp512.h"
#else
#include "exp256.h"
#endif

namespace {

constexpr int64_t D = 64;      // head_dim this kernel is built for: four vectors a row
constexpr int64_t KEYS = 16;   // keys per tile: one vector of scores per row
constexpr int64_t ROWS = 16;   // most rows (positions x grouped heads) per task
constexpr float kNoScore = -std::numeric_limits<float>::infinity();

struct Sequence {
  int64_t t0, q_len, ctx;  // its first token in q, its chunk's length, its context (cached + this chunk)
  const int32_t* table;
  float* keys_t;  // [ceil(ctx / KEYS)][Hkv][D][KEYS]: its keys, transposed per tile (bf16: packed K and V tiles)
};

struct Layout {
  int64_t Hkv, G, S, q_stride_t, q_stride_h;
  float scale;
};

// Keys [tile * 16, +16) of kv head h, transposed into [D][16] (lanes past the context stay 0).
void transpose_tile(const float* k_cache, const Sequence& sq, const Layout& ly, int64_t tile, int64_t h, float* out) {
  std::fill(out, out + D * KEYS, 0.f);
  const int64_t first = tile * KEYS, last = std::min(sq.ctx, first + KEYS);
  for (int64_t key = first; key < last; ++key) {
    const int64_t block = std::max<int32_t>(sq.table[key / ly.S], 0);
    const float* row = k_cache + ((block * ly.S + key % ly.S) * ly.Hkv + h) * D;
    for (int64_t d = 0; d < D; ++d) out[d * KEYS + key - first] = row[d];
  }
}

// The rows' queries times the softmax scale, their running maxima (none yet) and positions; rows r = i * G + g are
// positions i0 + i of the chunk, query head h * G + g.
void load_rows(const float* q, const Sequence& sq, const Layout& ly, int64_t h, int64_t i0, int64_t R, float (*qs)[D],
               float* mx, int64_t* pos) {
  const int64_t first_pos = sq.ctx - sq.q_len + i0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r / ly.G, g = r % ly.G;
    const float* src = q + (sq.t0 + i0 + i) * ly.q_stride_t + (h * ly.G + g) * ly.q_stride_h;
    for (int64_t d = 0; d < D; ++d) qs[r][d] = src[d] * ly.scale;
    mx[r] = kNoScore, pos[r] = first_pos + i;
  }
}

// Where the values of a tile's keys lie in the paged cache (kv head h); returns how many keys the tile has.
int64_t value_rows(const float* v_cache, const Sequence& sq, const Layout& ly, int64_t h, int64_t tile,
                   const float** vrows) {
  const int64_t first = tile * KEYS, keys = std::min(KEYS, sq.ctx - first);
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t key = first + j, block = std::max<int32_t>(sq.table[key / ly.S], 0);
    vrows[j] = v_cache + ((block * ly.S + key % ly.S) * ly.Hkv + h) * D;
  }
  return keys;
}

#if defined(__AVX512F__)
// One row's step of the online softmax over a tile of scores, of which the first `visible` (>= 1) count: returns
// e^(score - max) (0 past them), adds it to the row's per-lane sums, and where the tile raises the row's maximum first
// rescales what was summed under the old one (its output accumulator and sums).
inline __m512 softmax_tile(__m512 scores, int64_t visible, float& mx, float* acc, float* sum) {
  const __mmask16 live = visible >= KEYS ? 0xFFFF : static_cast<__mmask16>((1u << visible) - 1);
  const float tile_max = _mm512_mask_reduce_max_ps(live, scores);
  if (tile_max > mx) {
    const __m512 c = _mm512_set1_ps(std::exp(mx - tile_max));
    for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(acc + d, _mm512_mul_ps(_mm512_load_ps(acc + d), c));
    _mm512_store_ps(sum, _mm512_mul_ps(_mm512_load_ps(sum), c));
    mx = tile_max;
  }
  const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(scores, _mm512_set1_ps(mx))));
  _mm512_store_ps(sum, _mm512_add_ps(_mm512_load_ps(sum), e));
  return e;
}

// The R rows' outputs, normalized by their sums, into out [T, Hq, D].
void store_rows(const float (*acc)[D], const float (*sum)[KEYS], const Sequence& sq, const Layout& ly, int64_t h,
                int64_t i0, int64_t R, float* out) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r / ly.G, g = r % ly.G;
    float* dst = out + ((sq.t0 + i0 + i) * ly.Hkv * ly.G + h * ly.G + g) * D;
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(sum[r])));
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_load_ps(acc[r] + d), inv));
  }
}

// Positions [i0, i0 + positions) of one sequence's chunk, the G query heads of kv head h: rows r = i * G + g.
void attend_rows(const float* q, const float* v_cache, const Sequence& sq, const Layout& ly, int64_t h, int64_t i0,
                 int64_t positions, float* out) {
  const int64_t G = ly.G, R = positions * G, first_pos = sq.ctx - sq.q_len + i0;
  // Rows past R stay 0 and are computed along (a fixed trip count keeps the accumulators in registers), never stored.
  alignas(64) float qs[ROWS][D] = {};   // the rows' queries, times the softmax scale
  alignas(64) float acc[ROWS][D] = {};  // unnormalized outputs
  alignas(64) float p[ROWS][KEYS] = {};
  alignas(64) float sum[ROWS][KEYS] = {};  // per lane, added up once at the end
  float mx[ROWS];
  int64_t pos[ROWS];
  load_rows(q, sq, ly, h, i0, R, qs, mx, pos);
  const int64_t tiles = (first_pos + positions - 1) / KEYS + 1;  // through the last row's own key
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const float* kt = sq.keys_t + (tile * ly.Hkv + h) * D * KEYS;
    __m512 s[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) s[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 k = _mm512_load_ps(kt + d * KEYS);
      for (int64_t r = 0; r < ROWS; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(qs[r][d]), k, s[r]);
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t visible = std::min<int64_t>(KEYS, pos[r] - tile * KEYS + 1);  // causal: keys <= its position
      if (visible <= 0) {
        _mm512_store_ps(p[r], _mm512_setzero_ps());
        continue;
      }
      _mm512_store_ps(p[r], softmax_tile(s[r], visible, mx[r], acc[r], sum[r]));
    }
    // acc[r] += sum_j p[r][j] v_j, four rows at a time: 16 accumulators, each value row loaded once per four rows.
    const float* vrows[KEYS];
    const int64_t keys = value_rows(v_cache, sq, ly, h, tile, vrows);
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      __m512 a[4][4];
      for (int64_t r = 0; r < 4; ++r)
        for (int64_t c = 0; c < 4; ++c) a[r][c] = _mm512_load_ps(acc[r0 + r] + 16 * c);
      for (int64_t j = 0; j < keys; ++j) {
        const __m512 v0 = _mm512_loadu_ps(vrows[j]), v1 = _mm512_loadu_ps(vrows[j] + 16),
                     v2 = _mm512_loadu_ps(vrows[j] + 32), v3 = _mm512_loadu_ps(vrows[j] + 48);
        for (int64_t r = 0; r < 4; ++r) {
          const __m512 w = _mm512_set1_ps(p[r0 + r][j]);
          a[r][0] = _mm512_fmadd_ps(w, v0, a[r][0]);
          a[r][1] = _mm512_fmadd_ps(w, v1, a[r][1]);
          a[r][2] = _mm512_fmadd_ps(w, v2, a[r][2]);
          a[r][3] = _mm512_fmadd_ps(w, v3, a[r][3]);
        }
      }
      for (int64_t r = 0; r < 4 && r0 + r < R; ++r)
        for (int64_t c = 0; c < 4; ++c) _mm512_store_ps(acc[r0 + r] + 16 * c, a[r][c]);
    }
  }
  store_rows(acc, sum, sq, ly, h, i0, R, out);
}

#else
// AVX2: a tile's 16 scores of a row are two 8-lane vectors; otherwise as the AVX-512 code above (one row's online
// softmax step, the outputs' normalization, the rows' tiles), in register-sized pieces: four rows' scores at a time,
// and each value row added into two rows' accumulators half a head (32 dimensions) at a time.
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// scores: the tile's 16 scores (keys 0-7, 8-15) -> e^(score - max) into e, 0 past `visible`.
inline void softmax_tile(const __m256 scores[2], int64_t visible, float& mx, float* acc, float* sum, float* e) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 none = _mm256_set1_ps(kNoScore);
  __m256 live[2], masked[2];
  for (int c = 0; c < 2; ++c) {
    live[c] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(visible - 8 * c)), lane));
    masked[c] = _mm256_blendv_ps(none, scores[c], live[c]);
  }
  const float tile_max = hmax8(_mm256_max_ps(masked[0], masked[1]));
  if (tile_max > mx) {
    const __m256 c = _mm256_set1_ps(std::exp(mx - tile_max));
    for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(acc + d, _mm256_mul_ps(_mm256_load_ps(acc + d), c));
    for (int64_t d = 0; d < KEYS; d += 8) _mm256_store_ps(sum + d, _mm256_mul_ps(_mm256_load_ps(sum + d), c));
    mx = tile_max;
  }
  for (int c = 0; c < 2; ++c) {
    const __m256 x = _mm256_and_ps(live[c], exp_nonpositive256(_mm256_sub_ps(masked[c], _mm256_set1_ps(mx))));
    _mm256_store_ps(e + 8 * c, x);
    _mm256_store_ps(sum + 8 * c, _mm256_add_ps(_mm256_load_ps(sum + 8 * c), x));
  }
}

void store_rows(const float (*acc)[D], const float (*sum)[KEYS], const Sequence& sq, const Layout& ly, int64_t h,
                int64_t i0, int64_t R, float* out) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r / ly.G, g = r % ly.G;
    float* dst = out + ((sq.t0 + i0 + i) * ly.Hkv * ly.G + h * ly.G + g) * D;
    const __m256 inv = _mm256_set1_ps(1.f / hsum8(_mm256_add_ps(_mm256_load_ps(sum[r]), _mm256_load_ps(sum[r] + 8))));
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_load_ps(acc[r] + d), inv));
  }
}

void attend_rows(const float* q, const float* v_cache, const Sequence& sq, const Layout& ly, int64_t h, int64_t i0,
                 int64_t positions, float* out) {
  const int64_t G = ly.G, R = positions * G, first_pos = sq.ctx - sq.q_len + i0;
  alignas(64) float qs[ROWS][D] = {};
  alignas(64) float acc[ROWS][D] = {};
  alignas(64) float p[ROWS][KEYS] = {};
  alignas(64) float sum[ROWS][KEYS] = {};
  float mx[ROWS];
  int64_t pos[ROWS];
  load_rows(q, sq, ly, h, i0, R, qs, mx, pos);
  const int64_t tiles = (first_pos + positions - 1) / KEYS + 1;
  const int64_t rows4 = (R + 3) / 4 * 4;  // rows past R are zeros, computed along and never used
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const float* kt = sq.keys_t + (tile * ly.Hkv + h) * D * KEYS;
    for (int64_t r0 = 0; r0 < rows4; r0 += 4) {
      __m256 s[4][2];
      for (int64_t r = 0; r < 4; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m256 k0 = _mm256_load_ps(kt + d * KEYS), k1 = _mm256_load_ps(kt + d * KEYS + 8);
        for (int64_t r = 0; r < 4; ++r) {
          const __m256 x = _mm256_broadcast_ss(&qs[r0 + r][d]);
          s[r][0] = _mm256_fmadd_ps(x, k0, s[r][0]);
          s[r][1] = _mm256_fmadd_ps(x, k1, s[r][1]);
        }
      }
      for (int64_t r = r0; r < std::min(r0 + 4, R); ++r) {
        const int64_t visible = std::min<int64_t>(KEYS, pos[r] - tile * KEYS + 1);
        if (visible <= 0) {
          std::fill(p[r], p[r] + KEYS, 0.f);
          continue;
        }
        softmax_tile(s[r - r0], visible, mx[r], acc[r], sum[r], p[r]);
      }
    }
    const float* vrows[KEYS];
    const int64_t keys = value_rows(v_cache, sq, ly, h, tile, vrows);
    for (int64_t r0 = 0; r0 < R; r0 += 2) {
      for (int64_t half = 0; half < D; half += D / 2) {
        __m256 a[2][4];
        for (int64_t r = 0; r < 2; ++r)
          for (int64_t c = 0; c < 4; ++c) a[r][c] = _mm256_load_ps(acc[r0 + r] + half + 8 * c);
        for (int64_t j = 0; j < keys; ++j) {
          const float* v = vrows[j] + half;
          const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                       v3 = _mm256_loadu_ps(v + 24);
          for (int64_t r = 0; r < 2; ++r) {
            const __m256 w = _mm256_broadcast_ss(&p[r0 + r][j]);
            a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
            a[r][2] = _mm256_fmadd_ps(w, v2, a[r][2]);
            a[r][3] = _mm256_fmadd_ps(w, v3, a[r][3]);
          }
        }
        for (int64_t r = 0; r < 2 && r0 + r < R; ++r)
          for (int64_t c = 0; c < 4; ++c) _mm256_store_ps(acc[r0 + r] + half + 8 * c, a[r][c]);
      }
    }
  }
  store_rows(acc, sum, sq, ly, h, i0, R, out);
}
#endif

#if defined(__AVX512BF16__)
constexpr int64_t PAIRS = D / 2 * KEYS;  // 32-bit words in a packed key tile, and in a packed value tile

inline uint32_t bf16_bits(float x) {  // round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
}

inline uint32_t bf16_pair(float lo, float hi) { return bf16_bits(lo) | (bf16_bits(hi) << 16); }

// Keys [tile * 16, +16) of kv head h as [D / 2][16] words (dimensions d, d + 1 of one key), then their values as
// [16 / 2][D] words (keys j, j + 1 of one dimension); lanes past the context stay 0.
void pack_tile_bf16(const float* k_cache, const float* v_cache, const Sequence& sq, const Layout& ly, int64_t tile,
                    int64_t h, uint32_t* out) {
  uint32_t* kt = out;
  uint32_t* vt = out + PAIRS;
  std::fill(out, out + 2 * PAIRS, 0u);
  const int64_t first = tile * KEYS, last = std::min(sq.ctx, first + KEYS);
  for (int64_t key = first; key < last; ++key) {
    const int64_t block = std::max<int32_t>(sq.table[key / ly.S], 0), j = key - first;
    const int64_t at = ((block * ly.S + key % ly.S) * ly.Hkv + h) * D;
    const float* krow = k_cache + at;
    const float* vrow = v_cache + at;
    for (int64_t d = 0; d < D / 2; ++d) kt[d * KEYS + j] = bf16_pair(krow[2 * d], krow[2 * d + 1]);
    for (int64_t d = 0; d < D; ++d) vt[j / 2 * D + d] |= bf16_bits(vrow[d]) << (16 * (j & 1));
  }
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// attend_rows with bfloat16 dot products (see the top of the file); tiles: this sequence's packed K and V tiles.
void attend_rows_bf16(const float* q, const Sequence& sq, const Layout& ly, int64_t h, int64_t i0, int64_t positions,
                      float* out) {
  const int64_t G = ly.G, R = positions * G, first_pos = sq.ctx - sq.q_len + i0;
  alignas(64) uint32_t qs[ROWS][D / 2] = {};  // the rows' queries times the softmax scale, in pairs
  alignas(64) float acc[ROWS][D] = {};
  alignas(64) uint16_t p[ROWS][KEYS] = {};  // this tile's probabilities, bfloat16
  alignas(64) float sum[ROWS][KEYS] = {};
  float mx[ROWS];
  int64_t pos[ROWS];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r / G, g = r % G;
    const float* src = q + (sq.t0 + i0 + i) * ly.q_stride_t + (h * G + g) * ly.q_stride_h;
    for (int64_t d = 0; d < D / 2; ++d) qs[r][d] = bf16_pair(src[2 * d] * ly.scale, src[2 * d + 1] * ly.scale);
    mx[r] = kNoScore, pos[r] = first_pos + i;
  }
  const uint32_t* tiles_kv = reinterpret_cast<const uint32_t*>(sq.keys_t);
  const int64_t tiles = (first_pos + positions - 1) / KEYS + 1;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const uint32_t* kt = tiles_kv + (tile * ly.Hkv + h) * 2 * PAIRS;
    const uint32_t* vt = kt + PAIRS;
    __m512 s[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) s[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D / 2; ++d) {
      const __m512bh k = as_bh(_mm512_load_si512(kt + d * KEYS));
      for (int64_t r = 0; r < ROWS; ++r) s[r] = _mm512_dpbf16_ps(s[r], as_bh(_mm512_set1_epi32(qs[r][d])), k);
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t visible = std::min<int64_t>(KEYS, pos[r] - tile * KEYS + 1);
      if (visible <= 0) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(p[r]), _mm256_setzero_si256());
        continue;
      }
      const __m512 e = softmax_tile(s[r], visible, mx[r], acc[r], sum[r]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(p[r]), (__m256i)_mm512_cvtneps_pbh(e));
    }
    const int64_t pairs = (std::min(KEYS, sq.ctx - tile * KEYS) + 1) / 2;  // past the context: zero values
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      __m512 a[4][4];
      for (int64_t r = 0; r < 4; ++r)
        for (int64_t c = 0; c < 4; ++c) a[r][c] = _mm512_load_ps(acc[r0 + r] + 16 * c);
      for (int64_t j = 0; j < pairs; ++j) {
        const __m512bh v0 = as_bh(_mm512_load_si512(vt + j * D)), v1 = as_bh(_mm512_load_si512(vt + j * D + 16)),
                       v2 = as_bh(_mm512_load_si512(vt + j * D + 32)), v3 = as_bh(_mm512_load_si512(vt + j * D + 48));
        for (int64_t r = 0; r < 4; ++r) {
          uint32_t w;
          std::memcpy(&w, p[r0 + r] + 2 * j, 4);
          const __m512bh pw = as_bh(_mm512_set1_epi32(w));
          a[r][0] = _mm512_dpbf16_ps(a[r][0], pw, v0);
          a[r][1] = _mm512_dpbf16_ps(a[r][1], pw, v1);
          a[r][2] = _mm512_dpbf16_ps(a[r][2], pw, v2);
          a[r][3] = _mm512_dpbf16_ps(a[r][3], pw, v3);
        }
      }
      for (int64_t r = 0; r < 4 && r0 + r < R; ++r)
        for (int64_t c = 0; c < 4; ++c) _mm512_store_ps(acc[r0 + r] + 16 * c, a[r][c]);
    }
  }
  store_rows(acc, sum, sq, ly, h, i0, R, out);
}
#endif

}  // namespace
#endif

// q [T, Hq, D] float32 (rows may be strided, as a view of the fused qkv), caches [blocks, S, Hkv, D] float32,
// block_tables [P, max_blocks], cu_seqlens_q [P + 1], context_lens [P] int32 -> out [T, Hq, D] float32. Returns
// false (out untouched) where this kernel is not built for the case: neither AVX-512 nor AVX2 + FMA, head_dim other
// than 64, more than 16 query heads per kv head, or other dtypes / layouts. bf16: bfloat16 dot products where the CPU
// has them (float32 otherwise).
bool paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                             torch::Tensor cu_seqlens_q, torch::Tensor context_lens, double scale, torch::Tensor out,
                             bool bf16) {
#if defined(TOKENWEIR_PREFILL_KERNEL)
  const bool fits = q.dim() == 3 && q.size(2) == D && q.stride(2) == 1 && q.scalar_type() == torch::kFloat32 &&
                    k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32 &&
                    k_cache.size(3) == D && out.is_contiguous() && out.sizes() == q.sizes() &&
                    out.scalar_type() == torch::kFloat32 && block_tables.scalar_type() == torch::kInt32 &&
                    block_tables.is_contiguous() && cu_seqlens_q.scalar_type() == torch::kInt32 &&
                    context_lens.scalar_type() == torch::kInt32 && q.size(1) % k_cache.size(2) == 0 &&
                    q.size(1) / k_cache.size(2) <= ROWS;
  if (!fits) return false;
  Layout ly{k_cache.size(2), q.size(1) / k_cache.size(2), k_cache.size(1), q.stride(0), q.stride(1),
            static_cast<float>(scale)};
  const int64_t P = context_lens.size(0), max_blocks = block_tables.size(1);
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  std::vector<Sequence> seqs;
  std::vector<int64_t> tile_offset;  // where each sequence's transposed keys start, in floats
  int64_t floats = 0;
  for (int64_t b = 0; b < P; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b];
    TORCH_CHECK(ctx[b] >= q_len, "context_lens must include the chunk's tokens");
    if (q_len == 0) continue;
    seqs.push_back({cu[b], q_len, ctx[b], block_tables.data_ptr<int32_t>() + b * max_blocks, nullptr});
    tile_offset.push_back(floats);
    floats += (ctx[b] + KEYS - 1) / KEYS * ly.Hkv * D * KEYS;
  }
  auto keys_t = torch::empty({std::max<int64_t>(floats, 1)}, q.options().dtype(torch::kFloat32));
  for (size_t s = 0; s < seqs.size(); ++s) seqs[s].keys_t = keys_t.data_ptr<float>() + tile_offset[s];
  // Phase 1: every sequence's keys, transposed per tile and kv head.
  std::vector<std::pair<int64_t, int64_t>> key_tiles;  // (sequence, tile)
  for (size_t s = 0; s < seqs.size(); ++s)
    for (int64_t t = 0; t < (seqs[s].ctx + KEYS - 1) / KEYS; ++t) key_tiles.emplace_back(s, t);
#if defined(__AVX512BF16__)
  const bool packed = bf16;
#else
  const bool packed = false;
#endif
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(key_tiles.size()), 8, [&](int64_t a, int64_t z) {
    for (int64_t i = a; i < z; ++i) {
      const auto [s, t] = key_tiles[i];
      for (int64_t h = 0; h < ly.Hkv; ++h) {
        float* tile = seqs[s].keys_t + (t * ly.Hkv + h) * D * KEYS;
#if defined(__AVX512BF16__)
        if (packed) {
          pack_tile_bf16(kp, vp, seqs[s], ly, t, h, reinterpret_cast<uint32_t*>(tile));
          continue;
        }
#endif
        transpose_tile(kp, seqs[s], ly, t, h, tile);
      }
    }
  });
  // Phase 2: tasks of (sequence, kv head, positions), handed out longest first from a shared counter, so the threads
  // end together (a causal chunk's last positions cost many times its first).
  const int64_t positions = std::max<int64_t>(1, ROWS / ly.G);
  struct Task {
    int64_t s, h, i0, n;
  };
  std::vector<Task> tasks;
  for (size_t s = 0; s < seqs.size(); ++s)
    for (int64_t i0 = 0; i0 < seqs[s].q_len; i0 += positions)
      for (int64_t h = 0; h < ly.Hkv; ++h)
        tasks.push_back({static_cast<int64_t>(s), h, i0, std::min(positions, seqs[s].q_len - i0)});
  std::sort(tasks.begin(), tasks.end(), [&](const Task& x, const Task& y) {
    return seqs[x.s].ctx - seqs[x.s].q_len + x.i0 > seqs[y.s].ctx - seqs[y.s].q_len + y.i0;
  });
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t count = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1)) < count;) {
      const Task& t = tasks[i];
#if defined(__AVX512BF16__)
      if (packed) {
        attend_rows_bf16(qp, seqs[t.s], ly, t.h, t.i0, t.n, op);
        continue;
      }
#endif
      attend_rows(qp, vp, seqs[t.s], ly, t.h, t.i0, t.n, op);
    }
  });
  return true;
#else
  (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)cu_seqlens_q, (void)context_lens, (void)scale;
  (void)out, (void)bf16;
  return false;
#endif
}
