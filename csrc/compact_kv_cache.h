// compact_kv_cache: argument checks shared by the CPU kernel and the CUDA binding (torch side).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

namespace specdec {

// One cache (one layer's keys or values) of shape [B, Hkv, S, D], in bytes.
struct KVCacheSlice {
  char* base;
  int64_t stride_b, stride_h, stride_s, stride_d;
};

struct CompactKVPlan {
  std::vector<KVCacheSlice> slices;  // every [B, Hkv, S, D] cache, 6-D buffers expanded to 2L
  int64_t batch = 0, heads = 0, capacity = 0, head_dim = 0, element_size = 0, max_accepted = 0;
};

// Check the op's arguments (types, ranks, shapes, devices, one dtype and shape for all caches,
// no two caches at the same address, no cache that at::has_internal_overlap finds overlapping
// itself) and, when `validate`, the index values (a device sync on CUDA).  Raises
// TypeError/ValueError naming the argument.
CompactKVPlan plan_compact_kv_cache(
    c10::ArrayRef<at::Tensor> caches,
    const at::Tensor& cache_seqlens,
    const at::Tensor& accepted_indices,
    const at::Tensor& num_accepted,
    bool validate,
    c10::DeviceType device_type);

}  // namespace specdec
