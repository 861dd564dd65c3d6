// Paged decode attention on CPU: one query token per sequence against its whole paged context, read in place through
// the block table (no gather into a padded copy, no mask, no per-head index_select), one task per (sequence, kv head,
// range of the context) so the G query heads sharing a kv head read each key and value once. float32 throughout; the
// torch reference in kernels/attention/reference.py is the oracle (tests/contract/kernels/test_cpu_ops.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__AVX512F__)
#include "exp512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "exp256.h"
#endif

namespace {

constexpr float kNoScore = -std::numeric_limits<float>::infinity();

// s[i] = e^(s[i] - max) in place, with the max and the sum: e^x one vector at a time (a scalar std::exp per score was
// most of a decode row's attention time). Every row takes this one path, alone or batched.
inline void softmax_unnormalized(float* s, int64_t L, float& mx, float& sum) {
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(kNoScore);
  for (int64_t i = 0; i < L; i += 16) {
    const __mmask16 live = L - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (L - i)) - 1);
    vmax = _mm512_mask_max_ps(vmax, live, vmax, _mm512_maskz_loadu_ps(live, s + i));
  }
  const float m = _mm512_reduce_max_ps(vmax);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t i = 0; i < L; i += 16) {
    const __mmask16 live = L - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (L - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        live, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + i), _mm512_set1_ps(m))));
    _mm512_mask_storeu_ps(s + i, live, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  mx = m;
  sum = _mm512_reduce_add_ps(vsum);
#elif defined(__AVX2__) && defined(__FMA__)
  const int64_t full = L / 8 * 8;
  __m256 vmax = _mm256_set1_ps(kNoScore);
  for (int64_t i = 0; i < full; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float m = *std::max_element(lanes, lanes + 8);
  for (int64_t i = full; i < L; ++i) m = std::max(m, s[i]);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t i = 0; i < full; i += 8) {
    const __m256 e = exp_nonpositive256(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(m)));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  _mm256_storeu_ps(lanes, vsum);
  float total = 0.f;
  for (float lane : lanes) total += lane;
  for (int64_t i = full; i < L; ++i) total += (s[i] = std::exp(s[i] - m));
  mx = m;
  sum = total;
#else
  const float m = *std::max_element(s, s + L);
  float total = 0.f;
  for (int64_t i = 0; i < L; ++i) total += (s[i] = std::exp(s[i] - m));
  mx = m;
  sum = total;
#endif
}


struct Shape {
  int64_t Hkv, G, S, nb, q_stride_b, q_stride_h;
  float scale;
};

// The G query heads of kv head h over tokens [t_begin, t_end) of one sequence: out[G][D] = sum_t p_t v_t with
// p_t = exp(s_t - max[g]) and sum[g] = sum_t p_t, unnormalized, so that ranges of one context can be merged.
// DC is head_dim when known at compile time (64, SmolLM2's): fixed-length loops vectorize without tails.
template <int DC>
void attend(const float* qrow, const float* kp, const float* vp, const int32_t* table, int64_t h, int64_t t_begin,
            int64_t t_end, int64_t Dr, const Shape& sh, std::vector<float>& scores, float* out, float* mx,
            float* sum) {
  const int64_t D = DC > 0 ? DC : Dr, G = sh.G, S = sh.S, token_stride = sh.Hkv * D, L = t_end - t_begin;
  scores.resize(G * L);
  for (int64_t t = t_begin; t < t_end;) {
    const int64_t block = std::max<int32_t>(table[t / S], 0), stop = std::min(t_end, (t / S + 1) * S);
    for (; t < stop; ++t) {
      const float* kt = kp + (block * S + t % S) * token_stride + h * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qrow + g * sh.q_stride_h;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qg[d] * kt[d];
        scores[g * L + t - t_begin] = s * sh.scale;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) softmax_unnormalized(scores.data() + g * L, L, mx[g], sum[g]);
  std::fill(out, out + G * D, 0.f);
  for (int64_t t = t_begin; t < t_end;) {
    const int64_t block = std::max<int32_t>(table[t / S], 0), stop = std::min(t_end, (t / S + 1) * S);
    for (; t < stop; ++t) {
      const float* vt = vp + (block * S + t % S) * token_stride + h * D;
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * L + t - t_begin];
        float* og = out + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) og[d] += p * vt[d];
      }
    }
  }
}

template <int DC>
void run(const float* qp, const float* kp, const float* vp, const int32_t* btp, const int32_t* lp, float* op,
         int64_t B, int64_t Dr, const Shape& sh) {
  const int64_t D = DC > 0 ? DC : Dr, G = sh.G, Hkv = sh.Hkv, max_len = sh.nb * sh.S, Hq = G * Hkv;
  // Batch 1 has only Hkv tasks (3 for SmolLM2): on 2 threads one thread would do two while the other waits. So each
  // context is split into up to `threads` ranges of whole blocks, none under 64 tokens (not worth a merge): 1.5-2x at
  // batch 1, 100-600 tokens, 2 threads. The split of a row depends on its own length and the thread count only, never
  // on the rest of the batch, so a row's output is bit for bit the same alone or batched (speculative decoding checks
  // drafts as extra rows of a step and must see plain decoding's numbers).
  const int64_t threads = at::get_num_threads();
  const int64_t min_span = std::max<int64_t>(sh.S, 64);
  std::vector<int64_t> first_task(B + 1, 0), splits(B), spans(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = std::min<int64_t>(lp[b], max_len);
    splits[b] = std::max<int64_t>(1, std::min<int64_t>(threads, L / min_span));
    spans[b] = ((L + splits[b] - 1) / splits[b] + sh.S - 1) / sh.S * sh.S;
    first_task[b + 1] = first_task[b] + Hkv * splits[b];
  }
  const int64_t tasks = first_task[B];
  const int64_t part_size = G * (D + 2);  // out [G][D], then max [G] and sum [G]
  std::vector<float> parts(tasks * part_size);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> stats(2 * G);
    int64_t b = std::upper_bound(first_task.begin(), first_task.end(), begin) - first_task.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first_task[b + 1]) ++b;
      const int64_t P = splits[b], h = (task - first_task[b]) / P, part = (task - first_task[b]) % P;
      const int64_t L = std::min<int64_t>(lp[b], max_len);
      const int64_t t_begin = std::min(L, part * spans[b]), t_end = std::min(L, t_begin + spans[b]);
      float* out = P > 1 ? parts.data() + task * part_size : op + (b * Hq + h * G) * D;
      float* mx = P > 1 ? out + G * D : stats.data();
      float* sum = mx + G;
      if (t_begin == t_end) {  // a padded row (zeros, as the Triton kernel leaves it), or a range past its context
        std::fill(out, out + G * D, 0.f);
        std::fill(mx, mx + G, kNoScore);
        std::fill(sum, sum + G, 0.f);
        continue;
      }
      const float* qrow = qp + b * sh.q_stride_b + h * G * sh.q_stride_h;
      attend<DC>(qrow, kp, vp, btp + b * sh.nb, h, t_begin, t_end, D, sh, scores, out, mx, sum);
      for (int64_t g = 0; P == 1 && g < G; ++g) {
        const float inv = 1.f / sum[g];
        for (int64_t d = 0; d < D; ++d) out[g * D + d] *= inv;
      }
    }
  });
  for (int64_t b = 0; b < B; ++b) {  // merge the P ranges of each (sequence, kv head), rescaled
    const int64_t P = splits[b];
    if (P == 1) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* first = parts.data() + (first_task[b] + h * P) * part_size;
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * Hq + h * G + g) * D;
        std::fill(o, o + D, 0.f);
        float m = kNoScore;
        for (int64_t p = 0; p < P; ++p) m = std::max(m, first[p * part_size + G * D + g]);
        if (m == kNoScore) continue;  // a padded row
        float total = 0.f;
        for (int64_t p = 0; p < P; ++p) {
          const float* part = first + p * part_size;
          const float w = std::exp(part[G * D + g] - m);
          total += w * part[G * D + G + g];
          for (int64_t d = 0; d < D; ++d) o[d] += w * part[g * D + d];
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  }
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "q [B,Hq,D], caches [N,S,Hkv,D]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
              v_cache.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  // q is usually a strided view into the fused qkv projection: read in place while each head's row is contiguous.
  auto qc = q.stride(2) == 1 ? q : q.contiguous();
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  const int64_t B = qc.size(0), Hq = qc.size(1), D = qc.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(3) == D, "Hq a multiple of Hkv, same head size");
  const Shape sh{Hkv, Hq / Hkv, k_cache.size(1), bt.size(1), qc.stride(0), qc.stride(1), static_cast<float>(scale)};
  auto out = torch::empty({B, Hq, D}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  if (D == 64) {
    run<64>(qp, kp, vp, btp, lp, op, B, D, sh);
  } else {
    run<0>(qp, kp, vp, btp, lp, op, B, D, sh);
  }
  return out;
}
