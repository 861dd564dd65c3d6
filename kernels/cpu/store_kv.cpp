// The KV cache write of every layer as plain row copies: the torch reference (index_copy_ after .long(), a validity
// mask and a host-side `all()`) costs ~45 us a layer at batch 1, most of it dispatch, for 768 bytes of data.
// Same contract as kernels/attention/reference.py store_kv, for key/value already in the cache's dtype (any element size).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

namespace {

template <typename Slot>
void copy_rows(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache, torch::Tensor& v_cache,
               const Slot* slots) {
  const int64_t N = key.size(0), H = key.size(1), D = key.size(2);
  const int64_t num_slots = k_cache.numel() / (H * D);
  // Checked before any write, so a bad mapping raises (as index_copy_ does) and leaves the caches untouched.
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(slots[i] >= -1 && slots[i] < num_slots, "store_kv: slot ", slots[i], " out of range [-1, ",
                num_slots, ")");
  }
  const int64_t esize = key.element_size();
  const int64_t head_bytes = D * esize, row_bytes = H * head_bytes;
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  // Strides in bytes: key and value are usually views into one fused qkv projection, not contiguous tensors.
  const int64_t ks0 = key.stride(0) * esize, ks1 = key.stride(1) * esize;
  const int64_t vs0 = value.stride(0) * esize, vs1 = value.stride(1) * esize;
  // A prefill chunk of thousands of rows is worth splitting; a decode step's handful is not.
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;  // a padded batch row
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(kc + slot * row_bytes + h * head_bytes, kp + i * ks0 + h * ks1, head_bytes);
        std::memcpy(vc + slot * row_bytes + h * head_bytes, vp + i * vs0 + h * vs1, head_bytes);
      }
    }
  });
}

}  // namespace

// False, having written nothing, where the copy would have to convert or gather (key/value in another dtype than the
// caches, head_dim strided, slots neither int32 nor int64): the caller then takes the reference.
bool store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key/value must be [N, Hkv, D]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), "slot_mapping must be [N]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == key.size(1) &&
              k_cache.size(3) == key.size(2), "caches must be [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key.is_cpu() && value.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu() && slot_mapping.is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous to flatten slots");
  const auto dtype = k_cache.scalar_type(), slot_dtype = slot_mapping.scalar_type();
  if (key.scalar_type() != dtype || value.scalar_type() != dtype || v_cache.scalar_type() != dtype ||
      key.stride(2) != 1 || value.stride(2) != 1 || (slot_dtype != torch::kInt64 && slot_dtype != torch::kInt32)) {
    return false;
  }
  if (key.numel() == 0) return true;
  auto slots = slot_mapping.contiguous();
  if (slot_dtype == torch::kInt64) {
    copy_rows(key, value, k_cache, v_cache, slots.data_ptr<int64_t>());
  } else {
    copy_rows(key, value, k_cache, v_cache, slots.data_ptr<int32_t>());
  }
  return true;
}
