// compact_kv_cache: argument checks shared by the CPU kernel and the CUDA binding (torch side).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

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

// One pool of a PAGED cache (one layer's keys or values, [num_blocks, block_size, Hkv, D] or
// [num_blocks, Hkv, block_size, D]), in bytes: stride_block between physical blocks,
// stride_slot between the rows of one block.
struct PagedKVPool {
  char* base;
  int64_t stride_block, stride_slot, stride_h, stride_d;
};

struct PagedCompactKVPlan {
  std::vector<PagedKVPool> pools;  // every per-layer pool, 6-D buffers expanded to 2L
  int64_t batch = 0, heads = 0, num_blocks = 0, block_size = 0, head_dim = 0, element_size = 0, max_accepted = 0,
          max_blocks_per_seq = 0;
  // Logical slots a block-table row addresses: max_blocks_per_seq * block_size.
  int64_t capacity() const { return max_blocks_per_seq * block_size; }
};

// Check the op's arguments (types, ranks, shapes, devices, one dtype and shape for all caches,
// no two caches at the same address, no cache that at::has_internal_overlap finds overlapping
// itself) and, when `validate`, the index values (a device sync on CUDA).  Raises
// TypeError/ValueError naming the argument.
CompactKVPlan plan_compact_kv_cache(c10::ArrayRef<at::Tensor> caches, const at::Tensor& cache_seqlens,
                                    const at::Tensor& accepted_indices, const at::Tensor& num_accepted, bool validate,
                                    c10::DeviceType device_type);

// The same for the paged op: `caches` holds per-layer pools in `kv_layout` ("NHD" or "HND")
// and/or [L, 2, ...] buffers of them, block_table is int32/int64 [B, max_blocks_per_seq].
// With `validate`, also the block ids of every slot read or written (in [0, num_blocks)) and
// that no physical slot the op writes is a live slot (committed prefix, or read or written by
// the op) of another sequence or of another logical slot: ValueError naming block_table.
PagedCompactKVPlan plan_paged_compact_kv_cache(c10::ArrayRef<at::Tensor> caches, const at::Tensor& cache_seqlens,
                                               const at::Tensor& accepted_indices, const at::Tensor& num_accepted,
                                               const at::Tensor& block_table, c10::string_view kv_layout, bool validate,
                                               c10::DeviceType device_type);

}  // namespace specdec
