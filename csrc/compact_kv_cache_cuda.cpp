// compact_kv_cache: CUDA binding (thin): checks, then one launch of the torch-free kernel in
// compact_kv_cache_kernel.cu on the current stream.
//
// The caches are handed to the kernel in its strided form (one base pointer and strides) when
// they are evenly spaced in memory with equal strides, which is the case for one
// [L, 2, B, Hkv, S, D] buffer (or the list of its 2L views): no host-to-device copy, CUDA
// graph capture works.  Separately allocated layers go through a table of per-cache base
// pointers and strides, copied to the device asynchronously from pinned memory; that form
// refuses stream capture (the captured copy would replay a stale host buffer).
//
// The paged op (paged_compact_kv_cache_native) goes the same way: its per-layer pools are
// described like caches (stride_b = bytes between physical blocks), one [L, 2, ...] pool
// buffer needs no copy and can be captured; the block table is read by the kernel itself.
#include "compact_kv_cache.cuh"
#include "compact_kv_cache.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace specdec {
namespace {

static_assert(sizeof(SpecdecKVSlice) == 4 * sizeof(int64_t), "SpecdecKVSlice is packed as 4 int64 in the table");

// The index tensors' fields of the launch arguments.
void describe_indices(SpecdecCompactKVArgs& a, const at::Tensor& cache_seqlens, const at::Tensor& accepted_indices,
                      const at::Tensor& num_accepted) {
  a.cache_seqlens = cache_seqlens.data_ptr();
  a.seqlens_stride = cache_seqlens.stride(0);
  a.seqlens_int64 = cache_seqlens.scalar_type() == at::kLong;
  a.accepted_indices = accepted_indices.data_ptr();
  a.indices_stride_b = accepted_indices.stride(0);
  a.indices_stride_m = accepted_indices.stride(1);
  a.indices_int64 = accepted_indices.scalar_type() == at::kLong;
  a.max_accepted = accepted_indices.size(1);
  a.num_accepted = num_accepted.data_ptr();
  a.counts_stride = num_accepted.stride(0);
  a.counts_int64 = num_accepted.scalar_type() == at::kLong;
}

// A dense cache or a pool as the kernel's table entry: byte strides between sequences (pool:
// between physical blocks), heads and slots (pool: between the rows of a block).
SpecdecKVSlice kernel_slice(const KVCacheSlice& s) { return {s.base, s.stride_b, s.stride_h, s.stride_s}; }
SpecdecKVSlice kernel_slice(const PagedKVPool& p) { return {p.base, p.stride_block, p.stride_h, p.stride_slot}; }

// The caches' fields of the launch arguments, once every cache's rows are found contiguous:
// the strided form when the caches allow it, else a device table of their bases and strides
// (returned, kept alive by the caller until the launch is enqueued; refused under stream
// capture).
template <typename Cache>
at::Tensor describe_caches(SpecdecCompactKVArgs& a, const char* op, const std::vector<Cache>& caches,
                           int64_t element_size, int64_t head_dim, const at::Device& device, cudaStream_t stream) {
  const int64_t num_caches = static_cast<int64_t>(caches.size());
  std::vector<SpecdecKVSlice> host(num_caches);
  for (int64_t c = 0; c < num_caches; ++c) {
    TORCH_CHECK_VALUE(caches[c].stride_d == element_size || head_dim == 1, op,
                      " on CUDA needs the last dimension (head_dim) of every cache contiguous; cache ", c,
                      " has an element stride of ", caches[c].stride_d / element_size);
    host[c] = kernel_slice(caches[c]);
  }
  const int form = specdec_compact_kv_cache_describe(&a, host.data(), num_caches, head_dim * element_size);
  TORCH_CHECK(form >= 0, "compact_kv_cache: malformed cache description");
  if (form == 1) return at::Tensor();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone,
              "compact_kv_cache: caches that are not one evenly spaced buffer need a host-to-device copy of "
              "their addresses, which cannot be captured in a CUDA graph; pass one [L, 2, ...] buffer");
  at::Tensor pinned = at::empty({num_caches * 4}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(pinned.data_ptr<int64_t>(), host.data(), static_cast<size_t>(num_caches) * sizeof(SpecdecKVSlice));
  // Pinned + non_blocking: a stream-ordered copy; the host block is recycled only after it.
  at::Tensor table = pinned.to(device, /*non_blocking=*/true);
  a.table = reinterpret_cast<const SpecdecKVSlice*>(table.data_ptr<int64_t>());
  return table;
}

void compact_kv_cache_cuda(at::TensorList caches, const at::Tensor& cache_seqlens, const at::Tensor& accepted_indices,
                           const at::Tensor& num_accepted, bool validate) {
  const CompactKVPlan plan =
      plan_compact_kv_cache(caches, cache_seqlens, accepted_indices, num_accepted, validate, c10::DeviceType::CUDA);
  if (plan.slices.empty() || plan.batch == 0 || plan.heads == 0 || plan.capacity == 0 || plan.max_accepted == 0 ||
      plan.head_dim * plan.element_size == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(caches[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  SpecdecCompactKVArgs a{};
  const at::Tensor table =
      describe_caches(a, "compact_kv_cache", plan.slices, plan.element_size, plan.head_dim, caches[0].device(), stream);
  a.batch = plan.batch;
  a.heads = plan.heads;
  a.capacity = plan.capacity;
  describe_indices(a, cache_seqlens, accepted_indices, num_accepted);

  const cudaError_t err = specdec_compact_kv_cache(&a, stream);
  TORCH_CHECK(err == cudaSuccess, "compact_kv_cache: the CUDA launch failed: ", cudaGetErrorString(err));
}

// Paged: the pools go over as caches whose stride_b is the byte stride between physical
// blocks and stride_s between the rows of a block; the block table is read by the kernel.
void paged_compact_kv_cache_cuda(at::TensorList caches, const at::Tensor& cache_seqlens,
                                 const at::Tensor& accepted_indices, const at::Tensor& num_accepted,
                                 const at::Tensor& block_table, c10::string_view kv_layout, bool validate) {
  const PagedCompactKVPlan plan = plan_paged_compact_kv_cache(caches, cache_seqlens, accepted_indices, num_accepted,
                                                              block_table, kv_layout, validate, c10::DeviceType::CUDA);
  if (plan.pools.empty() || plan.batch == 0 || plan.heads == 0 || plan.num_blocks == 0 || plan.capacity() == 0 ||
      plan.max_accepted == 0 || plan.head_dim * plan.element_size == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(caches[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  SpecdecPagedCompactKVArgs p{};
  const at::Tensor table = describe_caches(p.kv, "paged compact_kv_cache", plan.pools, plan.element_size, plan.head_dim,
                                           caches[0].device(), stream);
  p.kv.batch = plan.batch;
  p.kv.heads = plan.heads;
  p.kv.capacity = plan.capacity();
  describe_indices(p.kv, cache_seqlens, accepted_indices, num_accepted);
  p.block_table = block_table.data_ptr();
  p.block_table_stride_b = block_table.stride(0);
  p.block_table_stride_m = block_table.stride(1);
  p.block_table_int64 = block_table.scalar_type() == at::kLong;
  p.max_blocks_per_seq = plan.max_blocks_per_seq;
  p.block_size = plan.block_size;
  p.num_blocks = plan.num_blocks;

  const cudaError_t err = specdec_paged_compact_kv_cache(&p, stream);
  TORCH_CHECK(err == cudaSuccess, "paged compact_kv_cache: the CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("compact_kv_cache_native", &specdec::compact_kv_cache_cuda);
  m.impl("paged_compact_kv_cache_native", &specdec::paged_compact_kv_cache_cuda);
}
