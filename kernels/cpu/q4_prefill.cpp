// y[M, N] = q8_1(x)[M, K] . W[N, K]^T for prefill chunks, W in q4_linear.cpp's packed Q4_1 rows: the same maths as
// q4_1_linear with one plane (llama.cpp's: activations rounded to Q8_1, a block's dot d * dx * sum(q * qx) + m * s),
// laid out for many rows instead of few.
//
// Why: a prefill chunk is compute-bound, and without VNNI or native bf16 (the AVX2 class) a float32 GEMM runs at the
// FMA units' peak, 8 products an instruction. One _mm256_maddubs_epi16 makes 32 products of 4-bit weights with 8-bit
// activations, and eight of them can add up in 16 bits before one _mm256_madd_epi16 widens them: a Q4_1 product
// pair is at most 2 * 15 * 127 = 3810, eight pairs 30480 < 32767, so nothing saturates and the integer dot is exact.
// On a 2-core AMD EPYC with AVX2 only, 1024 x 576 x 3072: ~400 GFLOP/s against float32 MKL's ~200.
//
// Layout: lanes are output columns, not blocks (q4_1_linear sums a row's blocks across lanes, then horizontally). For
// each panel of 8 weight rows the kernel gathers, per block, its four 4-byte words of nibble bytes: 32-bit lane c of
// vector p holds bytes 4p..4p+3 of column c's block, i.e. weights 4p..4p+3 in the low nibbles and 16+4p..19+4p in the
// high ones. Each activation word (4 consecutive int8) is broadcast to all lanes, so a row's 8 columns take two
// maddubs per word pair and no horizontal sums; the block's scales d and m are vectors of the 8 columns. The panel
// (K / 32 * 128 bytes) stays in L1 while every TILE_M-row tile of the activations passes it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "q4_1_layout.h"

namespace {

constexpr int64_t LANES = 8;  // output columns per panel
constexpr int TILE_M = 4;  // activation rows per pass over a panel: 4 int16 + 4 float accumulators in 16 registers

// A panel: 8 weight rows' nibble words [B][4 words][8 columns] and their d, m [B][8 columns] as float32. Columns past
// N are zeros.
struct Panel {
  std::vector<uint32_t> words;
  std::vector<float> d, m;
  explicit Panel(int64_t B) : words(B * 4 * LANES), d(B * LANES), m(B * LANES) {}

  void fill(const uint8_t* wp, int64_t B, int64_t n0, int64_t columns) {
    const int64_t row_bytes = B * ROW_BYTES_PER_BLOCK;
    std::fill(words.begin(), words.end(), 0u);
    std::fill(d.begin(), d.end(), 0.f);
    std::fill(m.begin(), m.end(), 0.f);
    for (int64_t c = 0; c < columns; ++c) {
      const uint8_t* row = wp + (n0 + c) * row_bytes;
      const uint16_t* half_d = reinterpret_cast<const uint16_t*>(row + B * NIBBLES);
      const uint16_t* half_m = half_d + B;
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t p = 0; p < 4; ++p)  // word p: nibble bytes 4p..4p+3, contiguous in either order
          std::memcpy(&words[(b * 4 + p) * LANES + c], row + nibble_byte_at(b, 4 * p, B), 4);
        d[b * LANES + c] = c10::detail::fp16_ieee_to_fp32_value(half_d[b]);
        m[b * LANES + c] = c10::detail::fp16_ieee_to_fp32_value(half_m[b]);
      }
    }
  }
};

// llama.cpp's quantize_row_q8_1 with float32 scales: per 32 values dx = amax / 127, q = round-half-even(x * 127 /
// amax), s = dx * sum(q). Natural order (the panel puts the weights in the activations' order).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs) {
  const int64_t B = K / QK;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t r = m0; r < m1; ++r)
      for (int64_t b = 0; b < B; ++b) {
        const float* v = x + r * K + b * QK;
        float amax = 0.f;
        for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
        const float inverse = amax != 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int64_t i = 0; i < QK; ++i) {
          const int32_t q = static_cast<int32_t>(std::nearbyint(v[i] * inverse));
          xq[r * K + b * QK + i] = static_cast<int8_t>(q);
          sum += q;
        }
        xd[r * B + b] = amax / 127.f;
        xs[r * B + b] = xd[r * B + b] * static_cast<float>(sum);
      }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// R activation rows x one panel -> y[R][8 columns] (row stride N; `columns` of them written).
template <int R>
inline void panel_rows(const Panel& panel, int64_t B, const int8_t* xq, const float* xd, const float* xs, int64_t K,
                       float* y, int64_t N, int64_t columns) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m256i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
    const uint32_t* words = panel.words.data() + b * 4 * LANES;
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + p * LANES));
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + b * QK + 4 * p;
        int32_t x_lo, x_hi;
        std::memcpy(&x_lo, xr, 4);
        std::memcpy(&x_hi, xr + 16, 4);
        dots[r] = _mm256_add_epi16(dots[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x_lo)));
        dots[r] = _mm256_add_epi16(dots[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x_hi)));
      }
    }
    const __m256 d = _mm256_loadu_ps(panel.d.data() + b * LANES);
    const __m256 m = _mm256_loadu_ps(panel.m.data() + b * LANES);
    for (int r = 0; r < R; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(dots[r], ones));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(xd[r * B + b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * B + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (columns == LANES) {
      _mm256_storeu_ps(y + r * N, acc[r]);
    } else {
      float out[LANES];
      _mm256_storeu_ps(out, acc[r]);
      std::memcpy(y + r * N, out, columns * sizeof(float));
    }
  }
}

void panel_tile(const Panel& panel, int64_t B, const int8_t* xq, const float* xd, const float* xs, int rows,
                int64_t K, float* y, int64_t N, int64_t columns) {
  switch (rows) {
    case 4: panel_rows<4>(panel, B, xq, xd, xs, K, y, N, columns); break;
    case 3: panel_rows<3>(panel, B, xq, xd, xs, K, y, N, columns); break;
    case 2: panel_rows<2>(panel, B, xq, xd, xs, K, y, N, columns); break;
    default: panel_rows<1>(panel, B, xq, xd, xs, K, y, N, columns); break;
  }
}
#else
void panel_tile(const Panel& panel, int64_t B, const int8_t* xq, const float* xd, const float* xs, int rows,
                int64_t K, float* y, int64_t N, int64_t columns) {
  for (int r = 0; r < rows; ++r)
    for (int64_t c = 0; c < columns; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        int32_t dot = 0;
        for (int p = 0; p < 4; ++p) {
          uint32_t word = panel.words[(b * 4 + p) * LANES + c];
          for (int t = 0; t < 4; ++t, word >>= 8) {
            dot += static_cast<int32_t>(word & 0x0F) * xq[r * K + b * QK + 4 * p + t];
            dot += static_cast<int32_t>((word >> 4) & 0x0F) * xq[r * K + b * QK + 16 + 4 * p + t];
          }
        }
        acc += static_cast<float>(dot) * (panel.d[b * LANES + c] * xd[r * B + b]);
        acc += panel.m[b * LANES + c] * xs[r * B + b];
      }
      y[r * N + c] = acc;
    }
}
#endif

}  // namespace

torch::Tensor q4_1_prefill(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "float32 x [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "uint8 packed Q4_1 rows [N, *]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), B = K / QK;
  TORCH_CHECK(K % QK == 0 && w.size(1) == B * ROW_BYTES_PER_BLOCK, "K a multiple of 32, rows of K / 32 * 20 bytes");
  auto xc = x.contiguous();
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * B), xs(M * B);
  quantize_rows(xc.data_ptr<float>(), M, K, xq.data(), xd.data(), xs.data());
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t panels = (N + LANES - 1) / LANES;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    Panel panel(B);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * LANES, columns = std::min(LANES, N - n0);
      panel.fill(wp, B, n0, columns);
      for (int64_t r = 0; r < M; r += TILE_M) {
        const int rows = static_cast<int>(std::min<int64_t>(TILE_M, M - r));
        panel_tile(panel, B, xq.data() + r * K, xd.data() + r * B, xs.data() + r * B, rows, K, yp + r * N + n0, N,
                   columns);
      }
    }
  });
  return y;
}
