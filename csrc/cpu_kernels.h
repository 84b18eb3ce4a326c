// The CPU kernels' pieces that one parallel region can run (decoder_layer_cpu.cpp's pass
// region): the int8 product (packed_linear_int8_cpu.cpp) as its checks, its activation
// quantisation over a range of blocks and its weight groups over a range of groups, and tree
// attention over a dense cache (paged_attention_cpu.cpp) as its checks and a range of its tasks.
// Each range function computes exactly what the op computes for that range: the op itself runs
// them over at::parallel_for, so a pass region and the ops give the same bits.
#pragma once

#include "common.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace specdec {

// ---------------------------------------------------------------- packed_linear_int8
// The quantised activations of one call: codes [R, I], and per row and block dx, sx, and the
// sum of the codes (the scaled8 VNNI path's correction).  Sized for at least R rows of I
// inputs before any range of blocks is written (int8_reserve).
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> qsum;
};

// A product's weights, checked (int8_check): codes, fp16 scales and mins (nullptr for scaled8),
// its kind (0 affine4, 1 scaled8), blocks per row nb = I / 32, groups G and out_features O.
struct Int8Weight {
  const uint8_t* qw;
  const uint16_t* dw;
  const uint16_t* mw;
  int kind;
  int64_t I, nb, G, O;
};

// The checks of torch.ops.specdec_engine.packed_linear_int8 for an input of I columns (the
// same messages); returns the weight's description.  The tensors must outlive its use.
Int8Weight int8_check(int64_t I, const at::Tensor& qw, const at::Tensor& dw, const c10::optional<at::Tensor>& mw,
                      int64_t kind, int64_t out_features);

// The path an isa request (0 best, 1 portable, 2 AVX2, 3 AVX-512 VNNI, 4 AMX) runs on this CPU;
// ValueError where the CPU cannot run it.
int64_t int8_path(int64_t isa);

// Sizes q for R rows of I inputs (I a multiple of 32); never shrinks it.
void int8_reserve(QuantX& q, int64_t R, int64_t I);

// Quantises the blocks b0 .. b1 - 1 of x (rows of I inputs back to back, 32 inputs a block)
// into q, on `path`'s quantisation (portable, or the AVX2 loop with the same bits).
void int8_quantize(int64_t path, const float* x, int64_t b0, int64_t b1, QuantX& q);

// y[r, 8 g0 .. 8 g1) for the R rows of q against w's groups g0 .. g1 - 1 (y [R, w.O]).
void int8_groups(int64_t path, const Int8Weight& w, const QuantX& q, int64_t R, float* y, int64_t g0, int64_t g1);

// ---------------------------------------------------------------- tree attention (dense cache)
// The work of one tree attention call cut into items that do not depend on the threads
// (paged_attention_cpu.cpp): item (b, group, split) walks split `split` (list positions
// SPLIT split .. SPLIT (split + 1) - 1) of the key lists of sequence b's rows for KV heads
// group HG .. group HG + HG - 1, into online-softmax states of its own; the rows' outputs
// then combine the states of their splits in order.
struct AttentionSplits {
  // raw_lens: cache_seqlens (clamped into [0, capacity - N] here); capacity: slots a sequence
  // can hold; heads_per_task: HG (a divisor of Hkv; only the speed depends on it)
  AttentionSplits(int64_t B, int64_t N, int64_t H, int64_t Hkv, int64_t D, const int64_t* raw_lens, int64_t capacity,
                  int64_t heads_per_task, const at::Tensor& mask);
  // items [*i0, *i1) of thread tid of T: contiguous ranges of nearly equal numbers of keys
  void range(int64_t tid, int64_t T, int64_t* i0, int64_t* i1) const;

  int64_t B, N, H, Hkv, D, G, R, HG, groups, items = 0;
  // per sequence: clamped length, splits, first item, first state; per item: keys before it
  std::vector<int64_t> len, splits, item0, state0, weight0;
  // the tree slots node i of sequence b sees, in order: visible[visible0[b N + i] ..
  // visible0[b N + i + 1])
  std::vector<int32_t> visible;
  std::vector<int64_t> visible0;
  // per state (b, KV head h, split, row r of R = G N): running max, sum, flag of a non-finite
  // key, output (D floats)
  std::vector<float> m, l;
  std::vector<uint8_t> bad;
  float* acc = nullptr;
  std::unique_ptr<float[]> acc_buffer;
};

// tree_attention's inputs after its checks: the int64 lengths, the one-column block table of
// the dense cache read as a pool, the mask (undefined: a chain) and the call's items and states.
struct DenseAttention {
  at::Tensor lens, table, mask;
  std::unique_ptr<AttentionSplits> splits;
};

// The checks of torch.ops.specdec_native.tree_attention on q [B, N, H, D] float32 and the
// caches [B, Hkv, S, D] (the same messages), for a call split over `threads` threads.
DenseAttention dense_attention_prepare(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& cache_seqlens, const c10::optional<at::Tensor>& tree_mask,
                                       int64_t threads);

// Items i0 .. i1 - 1 (of a.splits->items) of tree attention into their states; k_cache and
// v_cache of the shape and strides the checks saw, their data read `offset` elements further
// (another layer of a stack of such caches, inside its storage).
void dense_attention_items(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t offset,
                           DenseAttention& a, double sm_scale, int64_t i0, int64_t i1);

// The outputs of units u0 .. u1 - 1 (unit (b N + i) H + h: query head h of node i of sequence
// b) into out [B, N, H, D] float32 contiguous, from the states every item has written.
void dense_attention_finish(const DenseAttention& a, at::Tensor& out, int64_t u0, int64_t u1);

}  // namespace specdec
