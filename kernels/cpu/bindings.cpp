// The CPU kernels as one extension module (kernels/cpu_ops.py compiles and loads it).
#include <torch/extension.h>

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "y = x @ dequant(w).T, scales per group of K / groups weights");
  m.def("paged_decode_attention", &paged_decode_attention, "one query token per sequence over its paged context");
}
