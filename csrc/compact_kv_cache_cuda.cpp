// compact_kv_cache: CUDA binding (thin): checks, then one launch of the torch-free kernel in
// compact_kv_cache_kernel.cu on the current stream.
//
// The caches are handed to the kernel in its strided form (one base pointer and strides) when
// they are evenly spaced in memory with equal strides, which is the case for one
// [L, 2, B, Hkv, S, D] buffer (or the list of its 2L views): no host-to-device copy, CUDA
// graph capture works.  Separately allocated layers go through a device table of per-cache
// base pointers and strides, built once per cache list (its contents are the key) and kept:
// the first call copies it to the device, later calls (a CUDA-graph capture included) reuse
// it without a copy.  A list never seen before refuses stream capture (its copy would be
// captured from a host buffer): call once outside the capture first.
//
// Errors: a CUDA error already pending before the launch is reported as an earlier one, not
// as this op's; the launch's own error is checked right after it.
//
// The paged op (paged_compact_kv_cache) goes the same way: its per-layer pools are
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
#include <map>
#include <mutex>
#include <tuple>
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

// The device tables of per-cache bases and strides made so far, keyed by (device index, the
// table's contents): a decode loop compacts the same cache list every step, so its table is
// copied to the device once and reused, CUDA-graph replays included.  Bounded: past
// kMaxTables lists a table is copied per call (and refused under capture), never evicted (a
// captured graph may hold its address).
constexpr size_t kMaxTables = 64;

at::Tensor device_table(const std::vector<SpecdecKVSlice>& host, const at::Device& device, cudaStream_t stream) {
  static std::mutex mutex;
  static std::map<std::tuple<int, std::vector<int64_t>>, at::Tensor> tables;
  std::vector<int64_t> words(host.size() * 4);
  std::memcpy(words.data(), host.data(), words.size() * sizeof(int64_t));
  auto key = std::make_tuple(static_cast<int>(device.index()), std::move(words));
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto found = tables.find(key);
    if (found != tables.end()) return found->second;
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone,
              "compact_kv_cache: caches that are not one evenly spaced buffer are handed to the kernel as a "
              "device table of their addresses, built by a host-to-device copy on the first call with this cache "
              "list; that copy cannot be captured in a CUDA graph: call compact_kv_cache once with these caches "
              "before the capture (the table is kept), or pass one [L, 2, ...] buffer");
  const int64_t n = static_cast<int64_t>(std::get<1>(key).size());
  at::Tensor pinned = at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(pinned.data_ptr<int64_t>(), std::get<1>(key).data(), static_cast<size_t>(n) * sizeof(int64_t));
  // A blocking copy: the table is ready for any stream (later calls may run on another one).
  at::Tensor table = pinned.to(device, /*non_blocking=*/false);
  const std::lock_guard<std::mutex> lock(mutex);
  if (tables.size() < kMaxTables) tables.emplace(std::move(key), table);
  return table;
}

// A CUDA error pending before this op launches belongs to an earlier launch (kernel errors
// are reported at the next CUDA call): report it as such instead of as this op's.
void check_no_earlier_error(const char* op) {
  const cudaError_t earlier = cudaGetLastError();
  TORCH_CHECK(earlier == cudaSuccess, op, ": a CUDA error from an earlier launch was pending before this call (",
              cudaGetErrorString(earlier), "); compute-sanitizer or CUDA_LAUNCH_BLOCKING=1 finds its source");
}

// The caches' fields of the launch arguments, once every cache's rows are found contiguous:
// the strided form when the caches allow it, else a device table of their bases and strides
// (``device_table``: returned, kept alive by the caller until the launch is enqueued).
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
  const at::Tensor table = device_table(host, device, stream);
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

  check_no_earlier_error("compact_kv_cache");
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

  check_no_earlier_error("paged compact_kv_cache");
  const cudaError_t err = specdec_paged_compact_kv_cache(&p, stream);
  TORCH_CHECK(err == cudaSuccess, "paged compact_kv_cache: the CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec_native, CUDA, m) {
  m.impl("compact_kv_cache", &specdec::compact_kv_cache_cuda);
  m.impl("paged_compact_kv_cache", &specdec::paged_compact_kv_cache_cuda);
}
