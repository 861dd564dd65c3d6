// Paged decode attention on CPU: one query token per sequence against its whole paged context, read in place through
// the block table (no gather into a padded copy, no mask, no per-head index_select), one task per (sequence, kv head)
// so the G query heads sharing a kv head read each key and value once. float32 throughout; the torch reference in
// kernels/reference.py is the oracle (tests/kernels/test_cpu_ops.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "q [B,Hq,D], caches [N,S,Hkv,D]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
              v_cache.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  auto qc = q.contiguous();
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  const int64_t B = qc.size(0), Hq = qc.size(1), D = qc.size(2);
  const int64_t S = k_cache.size(1), Hkv = k_cache.size(2), nb = bt.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(3) == D, "Hq a multiple of Hkv, same head size");
  const int64_t G = Hq / Hkv;
  auto out = torch::zeros_like(qc);
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = std::min<int64_t>(lp[b], nb * S);
      if (L <= 0) continue;  // a padded row: zeros, as the Triton kernel leaves it
      scores.assign(G * L, 0.f);
      const float* qrow = qp + (b * Hq + h * G) * D;
      for (int64_t t = 0; t < L; ++t) {
        const int64_t block = std::max<int32_t>(btp[b * nb + t / S], 0);
        const float* kt = kp + ((block * S + t % S) * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qrow + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kt[d];
          scores[g * L + t] = s * sc;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> denom(G);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        const float m = *std::max_element(sg, sg + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) sum += (sg[t] = std::exp(sg[t] - m));
        denom[g] = sum;
      }
      for (int64_t t = 0; t < L; ++t) {
        const int64_t block = std::max<int32_t>(btp[b * nb + t / S], 0);
        const float* vt = vp + ((block * S + t % S) * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * Hq + h * G + g) * D;
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
  return out;
}
