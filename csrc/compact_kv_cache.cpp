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
//
// Paged caches (paged_compact_kv_cache): `caches` holds per-layer block pools
// [num_blocks, block_size, Hkv, D] ("NHD") or [num_blocks, Hkv, block_size, D] ("HND") and/or
// [L, 2, ...] buffers of them; block_table [B, max_blocks_per_seq] maps a sequence's logical
// block to a physical block.  The same compaction on logical slots (proof below).
#include "compact_kv_cache.h"

#include "common.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace specdec {
namespace {

void check_index_tensor(const char* name, const at::Tensor& t, int64_t ndim, const at::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
                   " must have dtype int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == ndim, name, " must have ", ndim, " dimensions, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, " like the caches, got ", t.device());
}

// The index arguments both ops share: cache_seqlens [B], accepted_indices [B, M] and
// num_accepted [B], int32 or int64, on the caches' device.  `batch` is the caches' B (dense), or
// -1 to take B from cache_seqlens (paged); returns B.
int64_t check_index_args(const at::Tensor& cache_seqlens, const at::Tensor& accepted_indices,
                         const at::Tensor& num_accepted, const at::Device& device, int64_t batch) {
  check_index_tensor("cache_seqlens", cache_seqlens, 1, device);
  if (batch < 0) batch = cache_seqlens.size(0);
  TORCH_CHECK_VALUE(cache_seqlens.size(0) == batch, "cache_seqlens must have shape (", batch, ",), got ",
                    cache_seqlens.sizes());
  check_index_tensor("accepted_indices", accepted_indices, 2, device);
  TORCH_CHECK_VALUE(accepted_indices.size(0) == batch, "accepted_indices must have shape (", batch, ", M), got ",
                    accepted_indices.sizes());
  check_index_tensor("num_accepted", num_accepted, 1, device);
  TORCH_CHECK_VALUE(num_accepted.size(0) == batch, "num_accepted must have shape (", batch, ",), got ",
                    num_accepted.sizes());
  return batch;
}

// cache_seqlens, accepted_indices and num_accepted as contiguous int64 CPU tensors (copies
// where they are not so already), for the value checks and the CPU kernels.
struct IndexArrays {
  at::Tensor seqlens, indices, counts;
  const int64_t* sl;  // [B]
  const int64_t* ix;  // [B, M]
  const int64_t* cn;  // [B]
  int64_t batch, max_accepted;

  IndexArrays(const at::Tensor& cache_seqlens, const at::Tensor& accepted_indices, const at::Tensor& num_accepted)
      : seqlens(cache_seqlens.to(at::kCPU, at::kLong).contiguous()),
        indices(accepted_indices.to(at::kCPU, at::kLong).contiguous()),
        counts(num_accepted.to(at::kCPU, at::kLong).contiguous()),
        sl(seqlens.data_ptr<int64_t>()),
        ix(indices.data_ptr<int64_t>()),
        cn(counts.data_ptr<int64_t>()),
        batch(seqlens.size(0)),
        max_accepted(indices.size(1)) {}
};

// The value checks of the Python op that both ops share: for every sequence b, num_accepted in
// 0..M, and where it is positive cache_seqlens >= 0 and accepted_indices[b, :n] strictly
// increasing, >= their position and below capacity - cache_seqlens.  `capacity_text` names the
// capacity in the message ("S=64", or how the block table gives it).  Overflow-free: every
// comparison is between non-negative values.
void check_chain_values(const IndexArrays& v, int64_t capacity, const std::string& capacity_text) {
  const int64_t max_accepted = v.max_accepted;
  const int64_t* ix = v.ix;
  for (int64_t b = 0; b < v.batch; ++b) {
    const int64_t n = v.cn[b], start = v.sl[b];
    TORCH_CHECK_VALUE(n >= 0 && n <= max_accepted, "num_accepted must lie in 0..", max_accepted, ", got ", n,
                      " for sequence ", b);
    if (n == 0) continue;
    TORCH_CHECK_VALUE(start >= 0, "cache_seqlens must be >= 0, got ", start, " for sequence ", b);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t a = ix[b * max_accepted + i];
      TORCH_CHECK_VALUE(a >= i,
                        "accepted_indices[b, i] must be >= i (a token never moves to a later slot), got "
                        "accepted_indices[",
                        b, ", ", i, "] = ", a);
      TORCH_CHECK_VALUE(i == 0 || a > ix[b * max_accepted + i - 1],
                        "accepted_indices must be strictly increasing within num_accepted, got accepted_indices[", b,
                        ", ", i - 1, ":", i + 1, "] = ", ix[b * max_accepted + i - 1], ", ", a);
      TORCH_CHECK_VALUE(a < capacity - start, "cache_seqlens + accepted_indices must be below the capacity ",
                        capacity_text, ", got ", start, " + ", a, " for sequence ", b);
    }
  }
}

// A 4-D cache (one layer's keys or values) as its base and byte strides.
struct Strided4 {
  char* base;
  int64_t stride[4];
};

// The cache checks both ops share: one dtype, device and 4-D shape for all caches (6-D
// [L, 2, ...] buffers expanded into their 2L slices through their strides), no cache that
// overlaps itself, no two caches at one address.  `inner` / `outer` name the layouts in the
// messages, e.g. "[B, Hkv, S, D]" / "[L, 2, B, Hkv, S, D]".
std::vector<Strided4> expand_caches(c10::ArrayRef<at::Tensor> caches, c10::DeviceType device_type,
                                    const char* inner_name, const char* outer_name, std::vector<int64_t>& inner_sizes,
                                    int64_t& element_size) {
  TORCH_CHECK_VALUE(!caches.empty(), "caches must hold at least one tensor");
  const at::Tensor& first = caches[0];
  TORCH_CHECK_VALUE(first.dim() == 4 || first.dim() == 6, "caches[0] must be ", inner_name, " or ", outer_name,
                    ", got shape ", first.sizes());
  const at::Device device = first.device();
  TORCH_CHECK_VALUE(device.type() == device_type, "caches[0] must be on ", c10::DeviceTypeName(device_type), ", got ",
                    device);
  const at::IntArrayRef inner = first.sizes().slice(first.dim() - 4);
  inner_sizes.assign(inner.begin(), inner.end());
  element_size = static_cast<int64_t>(first.element_size());
  const int64_t esz = element_size;

  std::vector<Strided4> out;
  for (size_t k = 0; k < caches.size(); ++k) {
    const at::Tensor& t = caches[k];
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, "caches[", k, "] must be a dense (strided) tensor, got ", t.layout());
    TORCH_CHECK_VALUE(t.dim() == 4 || t.dim() == 6, "caches[", k, "] must be ", inner_name, " or ", outer_name,
                      ", got shape ", t.sizes());
    TORCH_CHECK_TYPE(t.scalar_type() == first.scalar_type(), "caches[", k, "] must have the dtype of caches[0] (",
                     first.scalar_type(), "), got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.device() == device, "caches[", k, "] must be on ", device, " like caches[0], got ", t.device());
    TORCH_CHECK_VALUE(t.sizes().slice(t.dim() - 4) == inner, "caches[", k, "] must end in ", inner_name, " = ", inner,
                      " like caches[0] (every layer's keys and values alike), got shape ", t.sizes());
    TORCH_CHECK_VALUE(t.dim() == 4 || t.size(1) == 2, "caches[", k, "] of 6 dimensions must be ", outer_name,
                      " (keys and values), got shape ", t.sizes());
    TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, "caches[", k,
                      "] overlaps itself (e.g. an expanded tensor) and cannot be written in place");
    if (t.numel() == 0) continue;
    const int64_t d = t.dim();
    Strided4 s{static_cast<char*>(t.data_ptr()),
               {t.stride(d - 4) * esz, t.stride(d - 3) * esz, t.stride(d - 2) * esz, t.stride(d - 1) * esz}};
    if (d == 4) {
      out.push_back(s);
    } else {
      for (int64_t l = 0; l < t.size(0); ++l) {
        for (int64_t kv = 0; kv < 2; ++kv) {
          Strided4 e = s;
          e.base += (l * t.stride(0) + kv * t.stride(1)) * esz;
          out.push_back(e);
        }
      }
    }
  }
  // Two caches at one address would be compacted twice (and race on CUDA).
  std::vector<char*> bases;
  bases.reserve(out.size());
  for (const Strided4& s : out) bases.push_back(s.base);
  std::sort(bases.begin(), bases.end());
  TORCH_CHECK_VALUE(std::adjacent_find(bases.begin(), bases.end()) == bases.end(),
                    "caches must not alias one another: two of them start at the same address");
  return out;
}

}  // namespace

CompactKVPlan plan_compact_kv_cache(c10::ArrayRef<at::Tensor> caches, const at::Tensor& cache_seqlens,
                                    const at::Tensor& accepted_indices, const at::Tensor& num_accepted, bool validate,
                                    c10::DeviceType device_type) {
  CompactKVPlan plan;
  std::vector<int64_t> inner;  // [B, Hkv, S, D]
  const std::vector<Strided4> all =
      expand_caches(caches, device_type, "[B, Hkv, S, D]", "[L, 2, B, Hkv, S, D]", inner, plan.element_size);
  plan.batch = inner[0];
  plan.heads = inner[1];
  plan.capacity = inner[2];
  plan.head_dim = inner[3];
  for (const Strided4& c : all) plan.slices.push_back({c.base, c.stride[0], c.stride[1], c.stride[2], c.stride[3]});
  check_index_args(cache_seqlens, accepted_indices, num_accepted, caches[0].device(), plan.batch);
  plan.max_accepted = accepted_indices.size(1);
  if (validate && plan.batch > 0) {
    check_chain_values(IndexArrays(cache_seqlens, accepted_indices, num_accepted), plan.capacity,
                       c10::str("S=", plan.capacity));
  }
  return plan;
}

namespace {

// The paged op's value checks: the dense op's on the capacity of the block table, then the
// block ids of the slots read and written and the sharing rule (see compact_kv_cache.h).
void check_paged_values(const at::Tensor& cache_seqlens, const at::Tensor& accepted_indices,
                        const at::Tensor& num_accepted, const at::Tensor& block_table, int64_t block_size,
                        int64_t num_blocks) {
  const IndexArrays v(cache_seqlens, accepted_indices, num_accepted);
  const at::Tensor table = block_table.to(at::kCPU, at::kLong).contiguous();
  const int64_t batch = v.batch, max_accepted = v.max_accepted, max_blocks = table.size(1);
  const int64_t capacity = max_blocks * block_size;
  const int64_t* sl = v.sl;
  const int64_t* ix = v.ix;
  const int64_t* cn = v.cn;
  const int64_t* bt = table.data_ptr<int64_t>();
  check_chain_values(v, capacity,
                     c10::str("of the block table, max_blocks_per_seq * block_size = ", max_blocks, " * ", block_size,
                              " = ", capacity));
  // Block ids of every slot read, then of every slot written (the Python op's order).
  for (int k = 0; k < 2; ++k) {
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < cn[b]; ++i) {
        const int64_t slot = sl[b] + (k == 0 ? ix[b * max_accepted + i] : i);
        const int64_t j = slot / block_size, blk = bt[b * max_blocks + j];
        TORCH_CHECK_VALUE(blk >= 0 && blk < num_blocks, "block_table[", b, ", ", j, "] = ", blk, " (the block of a ",
                          k == 0 ? "source" : "destination", " slot) must be a block of the pool, 0..", num_blocks - 1);
      }
    }
  }
  // Sharing: a physical slot the op writes must be reached from no other live logical slot
  // (a sequence's committed prefix, or a slot the op reads or writes for it).  Keys name
  // (sequence, logical slot) as b * capacity + slot.
  std::unordered_map<int64_t, int64_t> written;  // physical slot -> key of its writer
  auto physical = [&](int64_t b, int64_t slot) {
    return bt[b * max_blocks + slot / block_size] * block_size + slot % block_size;
  };
  auto refuse = [&](int64_t phys, int64_t key1, int64_t key2) {
    TORCH_CHECK_VALUE(false, "block_table maps logical slot ", key1 % capacity, " of sequence ", key1 / capacity,
                      " and logical slot ", key2 % capacity, " of sequence ", key2 / capacity,
                      " to the same physical slot (block ", phys / block_size, ", offset ", phys % block_size,
                      "), which compact_kv_cache writes: blocks holding a sequence's tree region must not be shared "
                      "(copy-on-write is the caller's job)");
  };
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < cn[b]; ++i) {
      if (ix[b * max_accepted + i] == i) continue;  // identity: nothing written
      const int64_t slot = sl[b] + i, phys = physical(b, slot), key = b * capacity + slot;
      const auto it = written.emplace(phys, key).first;
      if (it->second != key) refuse(phys, it->second, key);
    }
  }
  if (written.empty()) return;
  auto check_live = [&](int64_t b, int64_t slot) {
    const int64_t phys = physical(b, slot), key = b * capacity + slot;
    const auto it = written.find(phys);
    if (it != written.end() && it->second != key) refuse(phys, it->second, key);
  };
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < cn[b]; ++i) check_live(b, sl[b] + ix[b * max_accepted + i]);
  }
  std::unordered_set<int64_t> written_blocks;
  for (const auto& w : written) written_blocks.insert(w.first / block_size);
  for (int64_t b = 0; b < batch; ++b) {  // committed prefixes inside the written blocks
    for (int64_t j = 0; j < max_blocks && j * block_size < sl[b]; ++j) {
      if (written_blocks.count(bt[b * max_blocks + j]) == 0) continue;
      for (int64_t slot = j * block_size; slot < std::min(sl[b], (j + 1) * block_size); ++slot) check_live(b, slot);
    }
  }
}

}  // namespace

PagedCompactKVPlan plan_paged_compact_kv_cache(c10::ArrayRef<at::Tensor> caches, const at::Tensor& cache_seqlens,
                                               const at::Tensor& accepted_indices, const at::Tensor& num_accepted,
                                               const at::Tensor& block_table, c10::string_view kv_layout, bool validate,
                                               c10::DeviceType device_type) {
  const bool nhd = kv_layout == "NHD";
  TORCH_CHECK_VALUE(nhd || kv_layout == "HND", "kv_layout must be 'NHD' or 'HND', got '", std::string(kv_layout), "'");
  PagedCompactKVPlan plan;
  std::vector<int64_t> inner;  // [num_blocks, block_size, Hkv, D] or [num_blocks, Hkv, block_size, D]
  const std::vector<Strided4> all =
      nhd ? expand_caches(caches, device_type, "[num_blocks, block_size, Hkv, D]",
                          "[L, 2, num_blocks, block_size, Hkv, D]", inner, plan.element_size)
          : expand_caches(caches, device_type, "[num_blocks, Hkv, block_size, D]",
                          "[L, 2, num_blocks, Hkv, block_size, D]", inner, plan.element_size);
  const int slot_dim = nhd ? 1 : 2, head_dim = nhd ? 2 : 1;
  plan.num_blocks = inner[0];
  plan.block_size = inner[slot_dim];
  plan.heads = inner[head_dim];
  plan.head_dim = inner[3];
  for (const Strided4& c : all) {
    plan.pools.push_back({c.base, c.stride[0], c.stride[slot_dim], c.stride[head_dim], c.stride[3]});
  }
  const at::Device device = caches[0].device();

  plan.batch = check_index_args(cache_seqlens, accepted_indices, num_accepted, device, -1);
  check_index_tensor("block_table", block_table, 2, device);
  TORCH_CHECK_VALUE(block_table.size(0) == plan.batch, "block_table must have shape (", plan.batch,
                    ", max_blocks_per_seq), got ", block_table.sizes());
  plan.max_accepted = accepted_indices.size(1);
  plan.max_blocks_per_seq = block_table.size(1);
  if (validate && plan.batch > 0 && plan.max_accepted > 0 && plan.block_size > 0) {
    check_paged_values(cache_seqlens, accepted_indices, num_accepted, block_table, plan.block_size, plan.num_blocks);
  }
  return plan;
}

namespace {

// The loop of both CPU kernels.  Task (cache c, sequence b, head h), in parallel: with start =
// cache_seqlens[b], a[i] = accepted_indices[b, i] and n = num_accepted[b] clamped to [0, M],
// for i = 0, 1, ..., n-1 in that order, row start + i <- row start + a[i], skipping the
// identity.  row_of(c, b, h, slot) is the row of logical slot `slot` (unsigned: negative slots
// wrap above every capacity), or nullptr when it is outside the cache: such entries are
// skipped.  stride_d(c): the byte stride between the elements of cache c's rows.
template <typename RowOf, typename StrideD>
void compact_rows(const IndexArrays& v, int64_t num_caches, int64_t H, int64_t head_dim, int64_t element_size,
                  RowOf row_of, StrideD stride_d) {
  const int64_t B = v.batch, M = v.max_accepted, row_bytes = head_dim * element_size;
  // Each task moves at most M rows; aim for >= 64 KiB per thread chunk.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, M * row_bytes));
  at::parallel_for(0, num_caches * B * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, b = (task / H) % B, c = task / (H * B);
      const int64_t n = clamp64(v.cn[b], 0, M);
      if (n == 0) continue;
      const int64_t sd = stride_d(c);
      const uint64_t start = static_cast<uint64_t>(v.sl[b]);
      for (int64_t i = 0; i < n; ++i) {
        // Unsigned wrap-around: negative or huge slots land outside the cache and are skipped.
        const uint64_t from = start + static_cast<uint64_t>(v.ix[b * M + i]);
        const uint64_t to = start + static_cast<uint64_t>(i);
        if (from == to) continue;
        const char* src = row_of(c, b, h, from);
        char* dst = row_of(c, b, h, to);
        if (src == nullptr || dst == nullptr) continue;
        if (sd == element_size || head_dim == 1) {
          std::memmove(dst, src, static_cast<size_t>(row_bytes));
        } else {
          for (int64_t d = 0; d < head_dim; ++d) {
            std::memmove(dst + d * sd, src + d * sd, static_cast<size_t>(element_size));
          }
        }
      }
    }
  });
}

// In-place correctness although sources and destinations overlap.  Within one (cache, b, h)
// slice, with start = cache_seqlens[b] and a[i] = accepted_indices[b, i], the loop above runs
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
  const int64_t S = plan.capacity;
  if (num_caches == 0 || plan.batch == 0 || plan.heads == 0 || S == 0 || plan.max_accepted == 0 ||
      plan.head_dim * plan.element_size == 0) {
    return;
  }
  auto row_of = [&](int64_t c, int64_t b, int64_t h, uint64_t slot) -> char* {
    if (slot >= static_cast<uint64_t>(S)) return nullptr;
    const KVCacheSlice& s = plan.slices[c];
    return s.base + b * s.stride_b + h * s.stride_h + static_cast<int64_t>(slot) * s.stride_s;
  };
  auto stride_d = [&](int64_t c) { return plan.slices[c].stride_d; };
  compact_rows(IndexArrays(cache_seqlens, accepted_indices, num_accepted), num_caches, plan.heads, plan.head_dim,
               plan.element_size, row_of, stride_d);
}

// Paged: the same loop on LOGICAL slots; logical slot s of sequence b is row s % block_size of
// physical block block_table[b, s / block_size].  In-place correctness: the dense argument
// above is about logical slots, and it carries over to physical rows when the block table is
// one-to-one on the rows the call touches, which the value checks enforce (validate=True):
//   - within one sequence, no physical slot that is written is also reached from a second
//     logical slot of the sequence (a block named twice), so "row start + a[i] was not written
//     before step i" holds for physical rows too;
//   - across sequences, a physical slot written for sequence b is no live slot (committed
//     prefix, source or destination) of another sequence, so tasks of different sequences
//     write disjoint rows and read no row another task writes: they run in parallel.  Shared
//     prefix blocks are only read where a source lies in them, never written.
// Bounds, whatever `validate` says: an entry whose source or destination is outside the table
// ([0, max_blocks_per_seq * block_size), compared unsigned so negative slots wrap above it) or
// whose block id is outside [0, num_blocks) is skipped, and the count is clamped to [0, M]:
// only rows of the given pools are touched.  Skipping is per entry, so skipped entries give
// the reference's result exactly (it skips the same ones).
void paged_compact_kv_cache_cpu(at::TensorList caches, const at::Tensor& cache_seqlens,
                                const at::Tensor& accepted_indices, const at::Tensor& num_accepted,
                                const at::Tensor& block_table, c10::string_view kv_layout, bool validate) {
  const PagedCompactKVPlan plan = plan_paged_compact_kv_cache(caches, cache_seqlens, accepted_indices, num_accepted,
                                                              block_table, kv_layout, validate, c10::DeviceType::CPU);
  const int64_t num_pools = static_cast<int64_t>(plan.pools.size());
  const int64_t MB = plan.max_blocks_per_seq, bs = plan.block_size, num_blocks = plan.num_blocks;
  const int64_t capacity = plan.capacity();
  if (num_pools == 0 || plan.batch == 0 || plan.heads == 0 || plan.max_accepted == 0 || capacity == 0 ||
      num_blocks == 0 || plan.head_dim * plan.element_size == 0) {
    return;
  }
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const int64_t* bt = table.data_ptr<int64_t>();
  auto row_of = [&](int64_t c, int64_t b, int64_t h, uint64_t slot) -> char* {
    if (slot >= static_cast<uint64_t>(capacity)) return nullptr;
    const int64_t s = static_cast<int64_t>(slot), blk = bt[b * MB + s / bs];
    if (static_cast<uint64_t>(blk) >= static_cast<uint64_t>(num_blocks)) return nullptr;
    const PagedKVPool& p = plan.pools[c];
    return p.base + h * p.stride_h + blk * p.stride_block + (s % bs) * p.stride_slot;
  };
  auto stride_d = [&](int64_t c) { return plan.pools[c].stride_d; };
  compact_rows(IndexArrays(cache_seqlens, accepted_indices, num_accepted), num_pools, plan.heads, plan.head_dim,
               plan.element_size, row_of, stride_d);
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec_native, CPU, m) {
  m.impl("compact_kv_cache", &specdec::compact_kv_cache_cpu);
  m.impl("paged_compact_kv_cache", &specdec::paged_compact_kv_cache_cpu);
}
