// compact_kv_cache: torch-free CUDA launcher for the KV-cache compaction after verification.
//
// After tree (or chain) verification the accepted nodes' keys and values sit at scattered
// slots cache_seqlens[b] + accepted_indices[b, i] of every layer's cache; this kernel moves
// them to slots cache_seqlens[b] + i, i < num_accepted[b], for all layers, keys and values
// and heads in ONE launch, in place.  The copy moves bytes, so any element type works.
//
// A "cache" here is one [batch, heads, capacity, row_bytes] slice (one layer's keys, or its
// values), addressed with byte strides; the row (one token of one head, head_dim elements)
// must be contiguous.  Two ways to give the caches:
//   - strided: cache c starts at base + (c / inner) * stride_outer + (c % inner) * stride_inner
//     and all caches share stride_b/h/s.  One [L, 2, B, Hkv, S, D] buffer is inner = 2,
//     stride_outer = its layer stride, stride_inner = its key/value stride.  No host-to-device
//     copy is needed, so this form can be captured in a CUDA graph.
//   - table: `table` points to num_caches SpecdecKVSlice entries in DEVICE memory, each with
//     its own base and strides (caches allocated separately).
//
// Safety: an index whose source or destination slot falls outside [0, capacity) is skipped
// (never read or written); num_accepted is clamped to [0, max_accepted]; accepted_indices is
// only read at columns below the clamped count.  So whatever the index values, the kernel
// touches only rows of the given caches.  The result matches the reference only for valid
// inputs (strictly increasing indices with accepted_indices[b, i] >= i, slots < capacity).
// The caches must not alias one another (each is written by its own thread blocks).
//
// specdec_paged_compact_kv_cache does the same on a paged cache (see SpecdecPagedCompactKVArgs).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// One cache in the table form.  Byte strides of the batch, head and slot dimensions.
typedef struct SpecdecKVSlice {
  char* base;
  int64_t stride_b;
  int64_t stride_h;
  int64_t stride_s;
} SpecdecKVSlice;

typedef struct SpecdecCompactKVArgs {
  // Caches: table form when `table` is not NULL, else the strided form.
  const SpecdecKVSlice* table;  // device memory, num_caches entries, or NULL
  char* base;                   // strided form: the first cache
  int64_t inner;                // strided form: caches per outer step (>= 1)
  int64_t stride_outer;         // strided form: bytes between outer steps
  int64_t stride_inner;         // strided form: bytes between inner steps
  int64_t stride_b;             // strided form: bytes between sequences
  int64_t stride_h;             // strided form: bytes between heads
  int64_t stride_s;             // strided form: bytes between slots
  int64_t num_caches;           // L * 2 for keys and values of L layers
  int64_t batch;                // B
  int64_t heads;                // Hkv
  int64_t capacity;             // S, slots per cache
  int64_t row_bytes;            // head_dim * element size; one slot of one head
  // A power of two dividing row_bytes, every cache base and every stride (in bytes): the
  // kernel moves min(alignment, 16)-byte words.  1 is always correct.
  int64_t alignment;
  // cache_seqlens [batch], int32 or int64, element stride seqlens_stride.
  const void* cache_seqlens;
  int64_t seqlens_stride;
  int seqlens_int64;
  // accepted_indices [batch, max_accepted], int32 or int64, element strides.
  const void* accepted_indices;
  int64_t indices_stride_b;
  int64_t indices_stride_m;
  int indices_int64;
  int64_t max_accepted;  // M
  // num_accepted [batch], int32 or int64, element stride counts_stride.
  const void* num_accepted;
  int64_t counts_stride;
  int counts_int64;
} SpecdecCompactKVArgs;

// Paged caches (vLLM / FlashInfer / TensorRT-LLM block pools).  `kv` describes the caches as
// above (strided or table form, filled by specdec_compact_kv_cache_describe) with these
// changes of meaning: each cache is one layer's keys or values POOL; stride_b is the byte
// stride between its physical BLOCKS and stride_s between the rows (slots) of one block;
// batch is the number of block-table rows; capacity is ignored (set from the table: a row
// addresses logical slots 0 .. max_blocks_per_seq * block_size - 1).  Logical slot s of
// sequence b is row s % block_size of block block_table[b, s / block_size].
//
// Safety: as above, plus an entry whose source or destination block id is outside
// [0, num_blocks) is skipped, and block_table is read only at columns below
// max_blocks_per_seq.  In-place correctness needs the block table to be one-to-one on the
// physical rows the call touches (no written block shared between sequences, no block named
// twice where it is written): the value checks of the torch op enforce it.
typedef struct SpecdecPagedCompactKVArgs {
  SpecdecCompactKVArgs kv;
  // block_table [batch, max_blocks_per_seq], int32 or int64, element strides.
  const void* block_table;
  int64_t block_table_stride_b;
  int64_t block_table_stride_m;
  int block_table_int64;
  int64_t max_blocks_per_seq;
  int64_t block_size;  // rows per block, >= 1
  int64_t num_blocks;  // physical blocks per pool
} SpecdecPagedCompactKVArgs;

// Enqueue the compaction on `stream`.  Returns cudaErrorInvalidValue for malformed arguments
// (negative sizes, NULL pointers where data is needed, alignment not a power of two), else
// the launch status.  Nothing is launched when there is no work.
cudaError_t specdec_compact_kv_cache(const SpecdecCompactKVArgs* args, cudaStream_t stream);

// The paged compaction: all pools (layers, keys and values) in ONE launch.  Same return
// values; also cudaErrorInvalidValue for a NULL block_table, block_size < 1 or negative
// table or pool sizes.
cudaError_t specdec_paged_compact_kv_cache(const SpecdecPagedCompactKVArgs* args, cudaStream_t stream);

// The width in bytes (16, 8, 4, 2 or 1) of the words the kernel will move for `args`.
int specdec_compact_kv_cache_word_bytes(const SpecdecCompactKVArgs* args);

// Host helper: fill the cache fields of `args` (num_caches, row_bytes, alignment and the
// strided form) from `num_caches` descriptions in HOST memory.  Returns 1 when the caches fit
// the strided form (equal strides; bases evenly spaced, or spaced by (layer, key/value)
// pairs); 0 when they need the table form: the caller copies `slices` to device memory and
// sets args->table; -1 on malformed arguments.  Other fields of `args` are left as they are.
int specdec_compact_kv_cache_describe(SpecdecCompactKVArgs* args, const SpecdecKVSlice* slices, int64_t num_caches,
                                      int64_t row_bytes);

#ifdef SPECDEC_COMPACT_KV_HOST_EMULATION
// Test build only: run the kernel's code on the host, block by block, each thread's loads of
// a chunk before any thread's stores (the barrier), with the launch configuration of
// specdec_compact_kv_cache (threads and blocks override it when > 0).  `table` must then be
// in host memory.  Returns 0, or -1 on malformed arguments.
int specdec_compact_kv_cache_emulate(const SpecdecCompactKVArgs* args, int64_t threads, int64_t blocks);
// The same for the paged kernel.
int specdec_paged_compact_kv_cache_emulate(const SpecdecPagedCompactKVArgs* args, int64_t threads, int64_t blocks);
#endif

#ifdef __cplusplus
}
#endif
