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
// tree_attention's inputs after its checks: the int64 lengths, the one-column block table of
// the dense cache read as a pool, and the mask (undefined: a chain).
struct DenseAttention {
  at::Tensor lens, table, mask;
  int64_t tasks, heads_per_task;
};

// The checks of torch.ops.specdec_native.tree_attention on q [B, N, H, D] float32 and the
// caches [B, Hkv, S, D] (the same messages), for a call split over `threads` threads.
DenseAttention dense_attention_prepare(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& cache_seqlens, const c10::optional<at::Tensor>& tree_mask,
                                       int64_t threads);

// Tasks t0 .. t1 - 1 (of a.tasks) of tree attention into out [B, N, H, D] float32 contiguous;
// k_cache and v_cache of the shape and strides the checks saw.
void dense_attention_tasks(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const DenseAttention& a, double sm_scale, at::Tensor& out, int64_t t0, int64_t t1);

}  // namespace specdec
