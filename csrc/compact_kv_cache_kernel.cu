// compact_kv_cache: CUDA kernel (torch-free; the torch binding is compact_kv_cache_cuda.cpp).
//
// One thread block owns one (cache, sequence b, head h) slice, where a cache is one layer's
// keys or values; all layers, keys and values go in ONE launch (grid-stride over slices).
// Within a slice the block fills destination slots start + i, i = 0 .. n-1 (start =
// cache_seqlens[b], n = num_accepted[b]) from source slots start + accepted_indices[b, i].
//
// The n destination rows, seen as one array of n * row_words words (row-major: row i, word
// col), are processed in chunks of blockDim.x * kWords consecutive words, in ascending
// order.  For each chunk every thread first LOADS its words into registers, the block
// synchronises, then every thread STORES them (and the block synchronises again before the
// next chunk).
//
// Why this is correct in place although sources and destinations overlap (valid inputs:
// a[i] = accepted_indices[b, i] strictly increasing and a[i] >= i):
//   Word (r, col) of the slice is written once, by destination word (r, col) (row r = i).
//   It is read by destination word (j, col) exactly when a[j] = r.  If j = r the copy is the
//   identity and is skipped.  Otherwise j < r (a[j] >= j and a[j] != j), so the reading word
//   j * row_words + col comes BEFORE the writing word r * row_words + col in the ascending
//   order: it lies in the same chunk (read before the barrier, write after it) or in an
//   earlier chunk (separated by that chunk's barriers).  So every source word is read before
//   it is overwritten, by whichever thread does either.  Conversely a destination word is
//   never read after it was written, because a[j] = r with j > r is impossible (a[j] >= j).
//   This is the same argument that makes the sequential ascending loop of the CPU kernel
//   safe; the barriers make it hold across threads.
// For invalid inputs (validation off) the result differs from the reference but there is
// still no data race: within a chunk loads precede the barrier and stores follow it, and the
// closing barrier orders a chunk's stores before the next chunk's loads.
//
// Bounds: source or destination slots outside [0, capacity) are skipped, the count is
// clamped to [0, max_accepted] and accepted_indices is read only below it.  Slot arithmetic
// is done in unsigned 64-bit (wrapping, defined) and compared unsigned, so negative or huge
// values fall outside [0, capacity) and are skipped.
//
// Words: 16-byte (uint4) moves when row_bytes, every base and every stride are multiples of
// 16 bytes; otherwise the widest of 8, 4, 2, 1 bytes that divides them all.
//
// Paged caches (specdec_paged_compact_kv_cache, kPaged): the same kernel, the same grid of
// (cache, b, h) slices and the same ascending chunks over LOGICAL rows; only the address of a
// row changes: logical slot s of sequence b is row s % block_size of physical block
// block_table[b, s / block_size] (a per-word lookup in the table, cached).  Correctness in
// place: the argument above is about logical rows r; it holds for physical memory when the
// table is one-to-one on the rows the call touches, i.e. when (a) no physical row written for
// sequence b is reached from another logical row of b (a block named twice) and (b) no
// physical row written for b is a live row (committed prefix, source or destination) of
// another sequence.  (a) makes "word (r, col) is read, at its one physical place, before it
// is overwritten" hold within the block's slice; (b) makes the slices of different sequences
// (different thread blocks, unordered) disjoint in what they write and in what they read of
// each other's writes.  Different heads and caches are disjoint memory as in the dense case.
// The torch op's value checks refuse tables that break (a) or (b) (copy-on-write is the
// caller's job).  Shared prefix blocks are only read, never written.
// Bounds: besides the dense rules, an entry whose source or destination block id is outside
// [0, num_blocks) is skipped, and the table is read only at columns < max_blocks_per_seq
// (the slot's block index is checked before the read), so no byte outside the pools is
// touched whatever the values; a table that breaks (a) or (b) gives unspecified values (and
// across thread blocks a race) in the pools only.
//
// The per-slice and per-chunk steps are __host__ __device__ functions: built with
// -DSPECDEC_COMPACT_KV_HOST_EMULATION this file also exports specdec_compact_kv_cache_emulate,
// which runs the same code on the host (all loads of a chunk, then all stores: the barrier)
// so that the tests check the kernel's logic without a GPU (their "cuda_emulated" cases).
#include "compact_kv_cache.cuh"

#include <climits>
#include <cstdint>
#ifdef SPECDEC_COMPACT_KV_HOST_EMULATION
#include <vector>
#endif

namespace {

constexpr int kMaxThreads = 128;

// What one block needs to know about its (cache, b, h) slice.
struct SliceWork {
  char* slice;           // dense: slot 0 of this (b, h); paged: head h of block 0, row 0
  int64_t stride_s;      // bytes between slots (paged: between the rows of one block)
  int64_t stride_block;  // paged: bytes between physical blocks
  uint64_t start;        // cache_seqlens[b] (wrapping arithmetic)
  int64_t n;             // rows to fill, clamped to [0, M]
  int64_t b;
};

__host__ __device__ __forceinline__ int64_t load_index(const void* p, int64_t offset, int is_int64) {
  return is_int64 ? static_cast<const int64_t*>(p)[offset]
                  : static_cast<int64_t>(static_cast<const int32_t*>(p)[offset]);
}

// Slice s = (c * batch + b) * heads + h.  False when it has nothing to move.
template <bool kTable, bool kPaged>
__host__ __device__ __forceinline__ bool slice_work(const SpecdecPagedCompactKVArgs& p, int64_t s, SliceWork& w) {
  const SpecdecCompactKVArgs& a = p.kv;
  const int64_t h = s % a.heads;
  const int64_t b = (s / a.heads) % a.batch;
  const int64_t c = s / (a.heads * a.batch);
  int64_t n = load_index(a.num_accepted, b * a.counts_stride, a.counts_int64);
  n = n < 0 ? 0 : (n > a.max_accepted ? a.max_accepted : n);
  if (n == 0) return false;
  w.n = n;
  w.b = b;
  w.start = static_cast<uint64_t>(load_index(a.cache_seqlens, b * a.seqlens_stride, a.seqlens_int64));
  char* base;
  int64_t stride_b;
  if constexpr (kTable) {
    const SpecdecKVSlice t = a.table[c];
    base = t.base + h * t.stride_h;
    stride_b = t.stride_b;
    w.stride_s = t.stride_s;
  } else {
    base = a.base + (c / a.inner) * a.stride_outer + (c % a.inner) * a.stride_inner + h * a.stride_h;
    stride_b = a.stride_b;
    w.stride_s = a.stride_s;
  }
  if constexpr (kPaged) {
    w.slice = base;  // the block is per row
    w.stride_block = stride_b;
  } else {
    w.slice = base + b * stride_b;
    w.stride_block = 0;
  }
  return true;
}

// a / b (b > 0) as a 32-bit division when both fit in 32 bits (the usual case: a 64-bit
// division is a long instruction sequence on the GPU), a 64-bit one otherwise.
__host__ __device__ __forceinline__ uint64_t div_u64(uint64_t a, uint64_t b) {
  return (a | b) <= 0xFFFFFFFFull ? static_cast<uint32_t>(a) / static_cast<uint32_t>(b) : a / b;
}

// The row of logical slot `slot` of the slice, or nullptr when it lies outside the cache (dense:
// slot >= capacity; paged: outside the table row or in a block outside [0, num_blocks)).
template <bool kPaged>
__host__ __device__ __forceinline__ char* row_of(const SpecdecPagedCompactKVArgs& p, const SliceWork& w,
                                                 uint64_t slot) {
  if constexpr (!kPaged) {
    return slot < static_cast<uint64_t>(p.kv.capacity) ? w.slice + static_cast<int64_t>(slot) * w.stride_s : nullptr;
  } else {
    const uint64_t bs = static_cast<uint64_t>(p.block_size);
    const uint64_t j = div_u64(slot, bs);
    if (j >= static_cast<uint64_t>(p.max_blocks_per_seq)) return nullptr;  // before reading the table
    const int64_t blk =
        load_index(p.block_table, w.b * p.block_table_stride_b + static_cast<int64_t>(j) * p.block_table_stride_m,
                   p.block_table_int64);
    if (static_cast<uint64_t>(blk) >= static_cast<uint64_t>(p.num_blocks)) return nullptr;
    return w.slice + blk * w.stride_block + static_cast<int64_t>(slot - j * bs) * w.stride_s;
  }
}

// How a thread's word index advances by `threads` words, in rows and columns of `row_words`
// words: one division per kernel (in compact_kv_cache_kernel), none per word.
struct WordStep {
  int64_t rows, cols;
};

// Thread `tid` of `threads`: load its words of the chunk starting at destination word
// `chunk` into registers, and where each goes (nullptr: nothing to store).  The word's row i
// (its accepted slot) and column advance by `step` from one word to the next: one division
// per chunk, and accepted_indices[b, i] is read once per row the thread meets, not per word.
template <typename Word, int kWords, bool kPaged>
__host__ __device__ __forceinline__ void load_chunk(const SpecdecPagedCompactKVArgs& p, const SliceWork& w,
                                                    int64_t row_words, WordStep step, int64_t chunk, int64_t tid,
                                                    Word* word, Word** dst) {
  const SpecdecCompactKVArgs& a = p.kv;
  // the row (accepted slot) of this thread's first word; chunk + tid >= 0, row_words >= 1
  int64_t i = static_cast<int64_t>(div_u64(static_cast<uint64_t>(chunk + tid), static_cast<uint64_t>(row_words)));
  int64_t col = chunk + tid - i * row_words;
  int64_t row_read = -1;  // the row whose index is in `from`
  uint64_t from = 0;
  const uint64_t start = w.start;
#pragma unroll
  for (int r = 0; r < kWords; ++r) {
    word[r] = Word{};
    dst[r] = nullptr;
    if (i < w.n) {
      if (i != row_read) {
        const int64_t idx =
            load_index(a.accepted_indices, w.b * a.indices_stride_b + i * a.indices_stride_m, a.indices_int64);
        from = start + static_cast<uint64_t>(idx);
        row_read = i;
      }
      const uint64_t to = start + static_cast<uint64_t>(i);
      if (from != to) {
        const char* src = row_of<kPaged>(p, w, from);
        char* dst_row = row_of<kPaged>(p, w, to);
        if (src != nullptr && dst_row != nullptr) {
          word[r] = reinterpret_cast<const Word*>(src)[col];
          dst[r] = reinterpret_cast<Word*>(dst_row) + col;
        }
      }
    }
    i += step.rows;  // the next word: `threads` words on
    col += step.cols;
    if (col >= row_words) {
      col -= row_words;
      ++i;
    }
  }
}

template <typename Word, int kWords>
__host__ __device__ __forceinline__ void store_chunk(const Word* word, Word* const* dst) {
#pragma unroll
  for (int r = 0; r < kWords; ++r) {
    if (dst[r] != nullptr) *dst[r] = word[r];
  }
}

template <typename Word, int kWords, bool kTable, bool kPaged>
__global__ void __launch_bounds__(kMaxThreads) compact_kv_cache_kernel(const SpecdecPagedCompactKVArgs p) {
  const SpecdecCompactKVArgs& a = p.kv;
  const int64_t num_slices = a.num_caches * a.batch * a.heads;
  const int64_t row_words = a.row_bytes / static_cast<int64_t>(sizeof(Word));
  const int64_t threads = blockDim.x;
  const int64_t step = threads * kWords;
  const WordStep word_step{threads / row_words, threads % row_words};  // once per thread
  for (int64_t s = blockIdx.x; s < num_slices; s += gridDim.x) {       // uniform over the block
    SliceWork w;
    if (!slice_work<kTable, kPaged>(p, s, w)) continue;
    const int64_t total = w.n * row_words;
    for (int64_t chunk = 0; chunk < total; chunk += step) {
      Word word[kWords];
      Word* dst[kWords];
      load_chunk<Word, kWords, kPaged>(p, w, row_words, word_step, chunk, threadIdx.x, word, dst);
      __syncthreads();  // every load of this chunk before any store of it
      store_chunk<Word, kWords>(word, dst);
      if (chunk + step < total) __syncthreads();  // this chunk's stores before the next loads
    }
  }
}

bool is_pow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

int word_bytes(const SpecdecCompactKVArgs& a) {
  int64_t w = a.alignment < 16 ? a.alignment : 16;
  if (!is_pow2(w)) return 1;
  while (w > 1 && a.row_bytes % w != 0) w /= 2;
  return static_cast<int>(w);
}

struct LaunchConfig {
  int64_t blocks, threads;
};

// Enough threads for the longest slice's first chunk, in whole warps, at most kMaxThreads;
// one block per slice (grid-stride beyond INT_MAX slices).
template <typename Word, int kWords>
LaunchConfig launch_config(const SpecdecCompactKVArgs& a) {
  const int64_t num_slices = a.num_caches * a.batch * a.heads;
  const int64_t words = a.max_accepted * (a.row_bytes / static_cast<int64_t>(sizeof(Word)));
  int64_t threads = (words + kWords - 1) / kWords;
  threads = (threads + 31) / 32 * 32;
  threads = threads < 32 ? 32 : (threads > kMaxThreads ? kMaxThreads : threads);
  return {num_slices < INT_MAX ? num_slices : INT_MAX, threads};
}

template <typename Word, int kWords, bool kPaged>
cudaError_t launch(const SpecdecPagedCompactKVArgs& p, cudaStream_t stream) {
  const LaunchConfig cfg = launch_config<Word, kWords>(p.kv);
  const dim3 grid(static_cast<unsigned>(cfg.blocks)), block(static_cast<unsigned>(cfg.threads));
  if (p.kv.table != nullptr) {
    compact_kv_cache_kernel<Word, kWords, true, kPaged><<<grid, block, 0, stream>>>(p);
  } else {
    compact_kv_cache_kernel<Word, kWords, false, kPaged><<<grid, block, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <bool kPaged>
cudaError_t launch_words(const SpecdecPagedCompactKVArgs& p, cudaStream_t stream) {
  switch (word_bytes(p.kv)) {
    case 16: return launch<uint4, 4, kPaged>(p, stream);
    case 8: return launch<uint2, 4, kPaged>(p, stream);
    case 4: return launch<uint32_t, 8, kPaged>(p, stream);
    case 2: return launch<uint16_t, 8, kPaged>(p, stream);
    default: return launch<uint8_t, 8, kPaged>(p, stream);
  }
}

// 0: nothing to do, 1: work, -1: malformed.
int check_args(const SpecdecCompactKVArgs& a) {
  if (a.num_caches < 0 || a.batch < 0 || a.heads < 0 || a.capacity < 0 || a.row_bytes < 0 || a.max_accepted < 0 ||
      !is_pow2(a.alignment)) {
    return -1;
  }
  if (a.num_caches == 0 || a.batch == 0 || a.heads == 0 || a.capacity == 0 || a.row_bytes == 0 || a.max_accepted == 0) {
    return 0;
  }
  if (a.cache_seqlens == nullptr || a.accepted_indices == nullptr || a.num_accepted == nullptr) return -1;
  if (a.table == nullptr && (a.base == nullptr || a.inner < 1)) return -1;
  return 1;
}

// The paged arguments with kv.capacity set from the table (max_blocks_per_seq * block_size),
// so that the dense checks and launch sizes apply.  0: nothing to do, 1: work, -1: malformed.
int paged_args(const SpecdecPagedCompactKVArgs* args, SpecdecPagedCompactKVArgs& p) {
  if (args == nullptr) return -1;
  p = *args;
  if (p.block_size < 1 || p.max_blocks_per_seq < 0 || p.num_blocks < 0 ||
      p.max_blocks_per_seq > INT64_MAX / p.block_size) {
    return -1;
  }
  p.kv.capacity = p.max_blocks_per_seq * p.block_size;
  const int status = check_args(p.kv);
  if (status <= 0) return status;
  if (p.num_blocks == 0) return 0;
  return p.block_table == nullptr ? -1 : 1;
}

int64_t address(const char* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }

// Whether every slice c starts at base0 + (c / inner) * outer + (c % inner) * step.
bool evenly_spaced(const SpecdecKVSlice* s, int64_t num, int64_t inner, int64_t outer, int64_t step) {
  for (int64_t c = 0; c < num; ++c) {
    if (address(s[c].base) != address(s[0].base) + (c / inner) * outer + (c % inner) * step) return false;
  }
  return true;
}

#ifdef SPECDEC_COMPACT_KV_HOST_EMULATION
template <typename Word, int kWords, bool kTable, bool kPaged>
void emulate(const SpecdecPagedCompactKVArgs& p, LaunchConfig cfg) {
  const SpecdecCompactKVArgs& a = p.kv;
  const int64_t num_slices = a.num_caches * a.batch * a.heads;
  const int64_t row_words = a.row_bytes / static_cast<int64_t>(sizeof(Word));
  const int64_t step = cfg.threads * kWords;
  const WordStep word_step{cfg.threads / row_words, cfg.threads % row_words};
  std::vector<Word> word(cfg.threads * kWords);
  std::vector<Word*> dst(cfg.threads * kWords);
  for (int64_t block = 0; block < cfg.blocks; ++block) {
    for (int64_t s = block; s < num_slices; s += cfg.blocks) {
      SliceWork w;
      if (!slice_work<kTable, kPaged>(p, s, w)) continue;
      for (int64_t chunk = 0; chunk < w.n * row_words; chunk += step) {
        for (int64_t t = 0; t < cfg.threads; ++t) {
          load_chunk<Word, kWords, kPaged>(p, w, row_words, word_step, chunk, t, &word[t * kWords], &dst[t * kWords]);
        }
        for (int64_t t = 0; t < cfg.threads; ++t) store_chunk<Word, kWords>(&word[t * kWords], &dst[t * kWords]);
      }
    }
  }
}

template <typename Word, int kWords, bool kPaged>
void emulate(const SpecdecPagedCompactKVArgs& p, int64_t threads, int64_t blocks) {
  LaunchConfig cfg = launch_config<Word, kWords>(p.kv);
  if (threads > 0) cfg.threads = threads;
  if (blocks > 0) cfg.blocks = blocks;
  if (p.kv.table != nullptr) {
    emulate<Word, kWords, true, kPaged>(p, cfg);
  } else {
    emulate<Word, kWords, false, kPaged>(p, cfg);
  }
}

template <bool kPaged>
void emulate_words(const SpecdecPagedCompactKVArgs& p, int64_t threads, int64_t blocks) {
  switch (word_bytes(p.kv)) {
    case 16: emulate<uint4, 4, kPaged>(p, threads, blocks); break;
    case 8: emulate<uint2, 4, kPaged>(p, threads, blocks); break;
    case 4: emulate<uint32_t, 8, kPaged>(p, threads, blocks); break;
    case 2: emulate<uint16_t, 8, kPaged>(p, threads, blocks); break;
    default: emulate<uint8_t, 8, kPaged>(p, threads, blocks); break;
  }
}
#endif

}  // namespace

extern "C" int specdec_compact_kv_cache_word_bytes(const SpecdecCompactKVArgs* args) {
  return args == nullptr ? 1 : word_bytes(*args);
}

extern "C" int specdec_compact_kv_cache_describe(SpecdecCompactKVArgs* args, const SpecdecKVSlice* s,
                                                 int64_t num_caches, int64_t row_bytes) {
  if (args == nullptr || s == nullptr || num_caches < 1 || row_bytes < 0) return -1;
  SpecdecCompactKVArgs& a = *args;
  a.num_caches = num_caches;
  a.row_bytes = row_bytes;
  a.table = nullptr;
  a.base = nullptr;
  a.inner = 1;
  a.stride_outer = a.stride_inner = a.stride_b = a.stride_h = a.stride_s = 0;

  bool same_strides = true;
  for (int64_t c = 0; c < num_caches; ++c) {
    same_strides = same_strides && s[c].stride_b == s[0].stride_b && s[c].stride_h == s[0].stride_h &&
                   s[c].stride_s == s[0].stride_s;
  }
  bool strided = false;
  if (same_strides) {
    const int64_t d1 = num_caches > 1 ? address(s[1].base) - address(s[0].base) : 0;
    const int64_t d2 = num_caches > 2 ? address(s[2].base) - address(s[0].base) : 0;
    if (evenly_spaced(s, num_caches, 1, d1, 0)) {  // a list of equally spaced caches
      strided = true;
      a.stride_outer = d1;
    } else if (num_caches % 2 == 0 && evenly_spaced(s, num_caches, 2, d2, d1)) {  // [L, 2, ...] not mergeable
      strided = true;
      a.inner = 2;
      a.stride_outer = d2;
      a.stride_inner = d1;
    }
  }
  int64_t bits = row_bytes | a.stride_outer | a.stride_inner;
  for (int64_t c = 0; c < num_caches; ++c) bits |= address(s[c].base) | s[c].stride_b | s[c].stride_h | s[c].stride_s;
  a.alignment = bits == 0 ? 16 : ((bits & -bits) < 16 ? (bits & -bits) : 16);
  if (!strided) return 0;
  a.base = s[0].base;
  a.stride_b = s[0].stride_b;
  a.stride_h = s[0].stride_h;
  a.stride_s = s[0].stride_s;
  return 1;
}

extern "C" cudaError_t specdec_compact_kv_cache(const SpecdecCompactKVArgs* args, cudaStream_t stream) {
  if (args == nullptr) return cudaErrorInvalidValue;
  const int status = check_args(*args);
  if (status <= 0) return status == 0 ? cudaSuccess : cudaErrorInvalidValue;
  SpecdecPagedCompactKVArgs p{};
  p.kv = *args;
  return launch_words<false>(p, stream);
}

extern "C" cudaError_t specdec_paged_compact_kv_cache(const SpecdecPagedCompactKVArgs* args, cudaStream_t stream) {
  SpecdecPagedCompactKVArgs p;
  const int status = paged_args(args, p);
  if (status <= 0) return status == 0 ? cudaSuccess : cudaErrorInvalidValue;
  return launch_words<true>(p, stream);
}

#ifdef SPECDEC_COMPACT_KV_HOST_EMULATION
extern "C" int specdec_compact_kv_cache_emulate(const SpecdecCompactKVArgs* args, int64_t threads, int64_t blocks) {
  if (args == nullptr) return -1;
  const int status = check_args(*args);
  if (status <= 0) return status;
  SpecdecPagedCompactKVArgs p{};
  p.kv = *args;
  emulate_words<false>(p, threads, blocks);
  return 0;
}

extern "C" int specdec_paged_compact_kv_cache_emulate(const SpecdecPagedCompactKVArgs* args, int64_t threads,
                                                      int64_t blocks) {
  SpecdecPagedCompactKVArgs p;
  const int status = paged_args(args, p);
  if (status <= 0) return status;
  emulate_words<true>(p, threads, blocks);
  return 0;
}
#endif
