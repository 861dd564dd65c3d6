// The CPU kernels as one extension module (kernels/cpu/ops.py compiles and loads it).
#include <torch/extension.h>

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, int64_t planes);
std::tuple<torch::Tensor, torch::Tensor> q8_quantize(torch::Tensor x);
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor w, int64_t planes);
torch::Tensor q4_1_dequantize(torch::Tensor w, int64_t K, bool bf16);
torch::Tensor q4_1_prefill(torch::Tensor x, torch::Tensor w);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);
bool paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                             torch::Tensor cu_seqlens_q, torch::Tensor context_lens, double scale, torch::Tensor out,
                             bool bf16);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
torch::Tensor silu_mul(torch::Tensor gate_up);
bool store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch only tensors through ATen, never Python objects, so they run without the GIL: the server's
  // event loop thread keeps serving while the engine thread computes. Arguments and results are converted with it.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("int8_linear", &int8_linear, nogil, "y = x @ dequant(w).T, scales per group of K / groups weights");
  m.def("q8_linear", &q8_linear, nogil, "y = q8(x) . dequant(w).T: x in 1 or 2 int8 planes per 32, integer dots");
  m.def("q8_quantize", &q8_quantize, nogil, "rows to int8 with one float32 scale per 32 values (llama.cpp's Q8_0)");
  m.def("q4_1_linear", &q4_1_linear, nogil, "y = q8_1(x) . w^T, w packed Q4_1 rows; x in 1 (llama.cpp) or 2 planes");
  m.def("q4_1_prefill", &q4_1_prefill, nogil, "q4_1_linear's maths (one plane) for prefill chunks: many rows");
  m.def("q4_1_dequantize", &q4_1_dequantize, nogil, "packed Q4_1 rows [N, K / 32 * 20] -> float32 or bfloat16 [N, K]");
  m.def("paged_decode_attention", &paged_decode_attention, nogil,
        "one query token per sequence over its paged context");
  m.def("paged_prefill_attention", &paged_prefill_attention, nogil,
        "varlen causal chunks over their paged context into out; false where the kernel does not cover the case");
  m.def("rms_norm", &rms_norm, nogil, "HF Llama RMSNorm, float32");
  m.def("rope_", &rope_, nogil, "rotate-half RoPE in place on the first heads of each row");
  m.def("silu_mul", &silu_mul, nogil, "silu(gate) * up of a fused [T, 2I] projection");
  m.def("store_kv", &store_kv, nogil, "key/value rows into the paged caches at their slots; false where it cannot");
}
