// compact_kv_cache: CPU kernel and the argument checks shared with the CUDA binding.
//
// For every cache (one layer's keys or values), sequence b, head h and i < num_accepted[b]:
// slot cache_seqlens[b] + i receives slot cache_seqlens[b] + accepted_indices[b, i]; nothing
// else changes (the KV path compaction after tree verification in SpecInfer / Medusa /
// EAGLE implementations).  The copy moves bytes: any dtype (float8, int8, ...).
//
// Layouts: `caches` holds [B, Hkv, S, D] tensors (e.g. the 2L keys and values of separately
// allocated layers) and/or [L, 2, B, Hkv, S, D] buffers, which are expanded into their 2L
// slices through their strides (never copied).  Any strides are accepted; rows whose last
// dimension is contiguous are moved with one memmove of D * element_size bytes, others
// element by element.  A cache that overlaps itself (e.g. an expanded tensor) is rejected.
#include "compact_kv_cache.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace specdec {
namespace {

void check_index_tensor(const char* name, const at::Tensor& t, int64_t ndim, const at::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
                   " must have dtype int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == ndim, name, " must have ", ndim, " dimensions, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, " like the caches, got ", t.device());
}

// The value checks of the Python op (specdec_kernels.reference.compact_kv_cache), on int64
// copies on the CPU.  Overflow-free: every comparison is between non-negative values.
void check_values(const at::Tensor& cache_seqlens, const at::Tensor& accepted_indices, const at::Tensor& num_accepted,
                  int64_t capacity) {
  const at::Tensor seqlens = cache_seqlens.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor indices = accepted_indices.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor counts = num_accepted.to(at::kCPU, at::kLong).contiguous();
  const int64_t batch = seqlens.size(0), max_accepted = indices.size(1);
  const int64_t* sl = seqlens.data_ptr<int64_t>();
  const int64_t* ix = indices.data_ptr<int64_t>();
  const int64_t* cn = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = cn[b], start = sl[b];
    TORCH_CHECK_VALUE(n >= 0 && n <= max_accepted, "num_accepted must lie in 0..", max_accepted, ", got ", n,
                      " for sequence ", b);
    if (n == 0) continue;
    TORCH_CHECK_VALUE(start >= 0, "cache_seqlens must be >= 0, got ", start, " for sequence ", b);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t a = ix[b * max_accepted + i];
      TORCH_CHECK_VALUE(a >= i, "accepted_indices[b, i] must be >= i (a token never moves to a later slot), got "
                        "accepted_indices[", b, ", ", i, "] = ", a);
      TORCH_CHECK_VALUE(i == 0 || a > ix[b * max_accepted + i - 1],
                        "accepted_indices must be strictly increasing within num_accepted, got accepted_indices[", b,
                        ", ", i - 1, ":", i + 1, "] = ", ix[b * max_accepted + i - 1], ", ", a);
      TORCH_CHECK_VALUE(a < capacity - start, "cache_seqlens + accepted_indices must be below the capacity S=",
                        capacity, ", got ", start, " + ", a, " for sequence ", b);
    }
  }
}

}  // namespace

CompactKVPlan plan_compact_kv_cache(c10::ArrayRef<at::Tensor> caches, const at::Tensor& cache_seqlens,
                                    const at::Tensor& accepted_indices, const at::Tensor& num_accepted, bool validate,
                                    c10::DeviceType device_type) {
  TORCH_CHECK_VALUE(!caches.empty(), "caches must hold at least one tensor");
  const at::Tensor& first = caches[0];
  TORCH_CHECK_VALUE(first.dim() == 4 || first.dim() == 6,
                    "caches[0] must be [B, Hkv, S, D] or [L, 2, B, Hkv, S, D], got shape ", first.sizes());
  const at::Device device = first.device();
  TORCH_CHECK_VALUE(device.type() == device_type, "caches[0] must be on ", c10::DeviceTypeName(device_type),
                    ", got ", device);
  const at::IntArrayRef inner = first.sizes().slice(first.dim() - 4);  // [B, Hkv, S, D]

  CompactKVPlan plan;
  plan.batch = inner[0];
  plan.heads = inner[1];
  plan.capacity = inner[2];
  plan.head_dim = inner[3];
  plan.element_size = static_cast<int64_t>(first.element_size());
  const int64_t esz = plan.element_size;

  for (size_t k = 0; k < caches.size(); ++k) {
    const at::Tensor& t = caches[k];
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, "caches[", k, "] must be a dense (strided) tensor, got ", t.layout());
    TORCH_CHECK_VALUE(t.dim() == 4 || t.dim() == 6, "caches[", k, "] must be [B, Hkv, S, D] or [L, 2, B, Hkv, S, D], got shape ",
                      t.sizes());
    TORCH_CHECK_TYPE(t.scalar_type() == first.scalar_type(), "caches[", k, "] must have the dtype of caches[0] (",
                     first.scalar_type(), "), got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.device() == device, "caches[", k, "] must be on ", device, " like caches[0], got ", t.device());
    TORCH_CHECK_VALUE(t.sizes().slice(t.dim() - 4) == inner, "caches[", k, "] must end in [B, Hkv, S, D] = ", inner,
                      " like caches[0] (every layer's keys and values alike), got shape ", t.sizes());
    TORCH_CHECK_VALUE(t.dim() == 4 || t.size(1) == 2, "caches[", k, "] of 6 dimensions must be [L, 2, B, Hkv, S, D] ",
                      "(keys and values), got shape ", t.sizes());
    TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, "caches[", k,
                      "] overlaps itself (e.g. an expanded tensor) and cannot be written in place");
    if (t.numel() == 0) continue;
    const int64_t d = t.dim();
    KVCacheSlice s{static_cast<char*>(t.data_ptr()), t.stride(d - 4) * esz, t.stride(d - 3) * esz,
                   t.stride(d - 2) * esz, t.stride(d - 1) * esz};
    if (d == 4) {
      plan.slices.push_back(s);
    } else {
      for (int64_t l = 0; l < t.size(0); ++l) {
        for (int64_t kv = 0; kv < 2; ++kv) {
          KVCacheSlice e = s;
          e.base += (l * t.stride(0) + kv * t.stride(1)) * esz;
          plan.slices.push_back(e);
        }
      }
    }
  }
  // Two caches at one address would be compacted twice (and race on CUDA).
  std::vector<char*> bases;
  bases.reserve(plan.slices.size());
  for (const KVCacheSlice& s : plan.slices) bases.push_back(s.base);
  std::sort(bases.begin(), bases.end());
  TORCH_CHECK_VALUE(std::adjacent_find(bases.begin(), bases.end()) == bases.end(),
                    "caches must not alias one another: two of them start at the same address");

  check_index_tensor("cache_seqlens", cache_seqlens, 1, device);
  TORCH_CHECK_VALUE(cache_seqlens.size(0) == plan.batch, "cache_seqlens must have shape (", plan.batch, ",), got ",
                    cache_seqlens.sizes());
  check_index_tensor("accepted_indices", accepted_indices, 2, device);
  TORCH_CHECK_VALUE(accepted_indices.size(0) == plan.batch, "accepted_indices must have shape (", plan.batch,
                    ", M), got ", accepted_indices.sizes());
  check_index_tensor("num_accepted", num_accepted, 1, device);
  TORCH_CHECK_VALUE(num_accepted.size(0) == plan.batch, "num_accepted must have shape (", plan.batch, ",), got ",
                    num_accepted.sizes());
  plan.max_accepted = accepted_indices.size(1);
  if (validate && plan.batch > 0) check_values(cache_seqlens, accepted_indices, num_accepted, plan.capacity);
  return plan;
}

namespace {

// In-place correctness although sources and destinations overlap.  Within one (cache, b, h)
// slice, with start = cache_seqlens[b] and a[i] = accepted_indices[b, i], the loop below runs
// i = 0, 1, ..., n-1 and does row[start + i] <- row[start + a[i]].  Claim: when step i reads
// row start + a[i], that row still holds its original content.  Rows written before step i
// are start + j for j < i.  For valid inputs a is strictly increasing with a[0] >= 0, hence
// a[i] >= i > j: the source row of step i is none of them.  (Step i itself writes row
// start + i only after reading, and skips the identity a[i] = i.)  So the ascending loop
// reads only untouched rows and equals the reference, which gathers all sources first.
// Different slices are disjoint memory (no cache overlaps itself, no two caches alias), so
// they run in parallel.  Invalid inputs (validate=False): slots outside [0, S) are skipped
// and the count is clamped to [0, M]; the result is then unspecified but stays in bounds.
void compact_kv_cache_cpu(at::TensorList caches, const at::Tensor& cache_seqlens, const at::Tensor& accepted_indices,
                          const at::Tensor& num_accepted, bool validate) {
  const CompactKVPlan plan =
      plan_compact_kv_cache(caches, cache_seqlens, accepted_indices, num_accepted, validate, c10::DeviceType::CPU);
  const int64_t num_caches = static_cast<int64_t>(plan.slices.size());
  const int64_t B = plan.batch, H = plan.heads, S = plan.capacity, M = plan.max_accepted;
  const int64_t row_bytes = plan.head_dim * plan.element_size;
  if (num_caches == 0 || B == 0 || H == 0 || S == 0 || M == 0 || row_bytes == 0) return;

  const at::Tensor seqlens = cache_seqlens.to(at::kLong).contiguous();
  const at::Tensor indices = accepted_indices.to(at::kLong).contiguous();
  const at::Tensor counts = num_accepted.to(at::kLong).contiguous();
  const int64_t* sl = seqlens.data_ptr<int64_t>();
  const int64_t* ix = indices.data_ptr<int64_t>();
  const int64_t* cn = counts.data_ptr<int64_t>();

  // Each task (cache, b, h) moves at most M rows; aim for >= 64 KiB per thread chunk.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, M * row_bytes));
  at::parallel_for(0, num_caches * B * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, b = (task / H) % B, c = task / (H * B);
      const int64_t n = std::min(std::max<int64_t>(cn[b], 0), M);
      if (n == 0) continue;
      const KVCacheSlice& s = plan.slices[c];
      char* slice = s.base + b * s.stride_b + h * s.stride_h;
      const uint64_t start = static_cast<uint64_t>(sl[b]);
      for (int64_t i = 0; i < n; ++i) {
        // Unsigned wrap-around: negative or huge slots compare as >= S and are skipped.
        const uint64_t from = start + static_cast<uint64_t>(ix[b * M + i]);
        const uint64_t to = start + static_cast<uint64_t>(i);
        if (from == to || from >= static_cast<uint64_t>(S) || to >= static_cast<uint64_t>(S)) continue;
        char* dst = slice + static_cast<int64_t>(to) * s.stride_s;
        const char* src = slice + static_cast<int64_t>(from) * s.stride_s;
        if (s.stride_d == plan.element_size || plan.head_dim == 1) {
          std::memmove(dst, src, static_cast<size_t>(row_bytes));
        } else {
          for (int64_t d = 0; d < plan.head_dim; ++d) {
            std::memmove(dst + d * s.stride_d, src + d * s.stride_d, static_cast<size_t>(plan.element_size));
          }
        }
      }
    }
  });
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("compact_kv_cache_native", &specdec::compact_kv_cache_cpu);
}
