// The CPU kernels as one extension module (kernels/cpu_ops.py compiles and loads it).
#include <torch/extension.h>

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales);
std::tuple<torch::Tensor, torch::Tensor> q8_quantize(torch::Tensor x);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
torch::Tensor silu_mul(torch::Tensor gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "y = x @ dequant(w).T, scales per group of K / groups weights");
  m.def("q8_linear", &q8_linear, "y = q8(x) . dequant(w).T: activations rounded to int8 per 32, integer dots");
  m.def("q8_quantize", &q8_quantize, "rows to int8 with one float32 scale per 32 values (llama.cpp's Q8_0)");
  m.def("paged_decode_attention", &paged_decode_attention, "one query token per sequence over its paged context");
  m.def("rms_norm", &rms_norm, "HF Llama RMSNorm, float32");
  m.def("rope_", &rope_, "rotate-half RoPE in place on the first heads of each row");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2I] projection");
}
