// One decoder layer of the engine's Llama-family model in one call (torch.ops.specdec_engine.decoder_layer),
// for CPU passes of a few tokens (decode steps and verification), where the time between the
// matrix products (a dozen small ATen ops and the Python around them) costs as much as the products.
//
// It runs the operations of specdec_kernels/decoding/model.py's Block.forward, in the same order,
// through the same native kernels (packed_linear, packed_linear_int8,
// tree_attention, silu_mul_rows); the rotary products and the residual adds are loops
// with the same roundings as the ATen ops (bit-identical), and RMSNorm is rms_norm_rows, the loop
// that torch.ops.specdec_engine.rms_norm (below) also runs for the Python layer, so that the two
// layers give the same bits.  Every row is computed alone, so a row's output does not depend on
// the others.
//
//   x [B, N, hidden] float32; attn_norm, ffn_norm [hidden]; cos, sin [B, N, 1, D];
//   k_cache, v_cache [B, Hkv, S, D] (views of the layer's cache, written in place at slots
//   cache_seqlens[b] + i, i < N); cache_seqlens int32 [B]; tree_mask None or bool [N, N] / [B, N, N];
//   qkv_bias None or [(H + 2 Hkv) D];
//   weights: 4 linears (wqkv, wo, w13, w2) x 3 slots, kinds[i] and out_features[i] per linear:
//     0 / 1 / 2: packed_linear of kind 0 (affine4: codes, scales, mins), 1 (scaled8: codes,
//                scales) or 2 (float32: the weight);
//     3:         at::linear with the weight;
//     4 / 5:     packed_linear_int8 of kind 0 (qw, dw, mw) or 1 (qw, dw).
// Returns the layer's output [B, N, hidden].
#include "common.h"
#include "cpu_kernels.h"
#include "vec8.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace specdec {
namespace {

using OptT = c10::optional<at::Tensor>;

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const OptT& mins,
                         int64_t kind) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("specdec_engine::packed_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&, int64_t, bool)>();
  return op.call(x, codes, scales, mins, kind, false);
}

at::Tensor packed_linear_int8(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& dw, const OptT& mw,
                              int64_t kind, int64_t out_features, int64_t isa) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdec_engine::packed_linear_int8", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&, int64_t,
                                         int64_t, int64_t)>();
  return op.call(x, qw, dw, mw, kind, out_features, isa);
}

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seqlens,
                          const OptT& mask, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdec_native::tree_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const OptT&, double)>();
  return op.call(q, k, v, seqlens, mask, scale);
}

at::Tensor slot(const std::vector<OptT>& w, int64_t i, int64_t s) {
  const OptT& t = w[3 * i + s];
  TORCH_CHECK_VALUE(given(t), "decoder_layer: linear ", i, " needs its weight tensor ", s);
  return *t;
}

// y = x @ W_i^T on the path kinds[i] names; x [rows, in].
at::Tensor run_linear(const at::Tensor& x, const std::vector<OptT>& w, int64_t i, int64_t kind, int64_t out,
                      int64_t isa) {
  switch (kind) {
    case 0: return packed_linear(x, slot(w, i, 0), slot(w, i, 1), slot(w, i, 2), 0);
    case 1: return packed_linear(x, slot(w, i, 0), slot(w, i, 1), c10::nullopt, 1);
    case 2: return packed_linear(x, slot(w, i, 0), at::empty({0}, x.options()), c10::nullopt, 2);
    case 3: return at::linear(x, slot(w, i, 0));
    case 4: return packed_linear_int8(x, slot(w, i, 0), slot(w, i, 1), slot(w, i, 2), 0, out, isa);
    case 5: return packed_linear_int8(x, slot(w, i, 0), slot(w, i, 1), c10::nullopt, 1, out, isa);
    default: TORCH_CHECK_VALUE(false, "decoder_layer: kinds[", i, "] must lie in 0..5, got ", kind);
  }
}

// y = run_linear(...) checked to be [rows, out] float32: the loops after each product read and
// write rows * out floats of it, so a weight whose rows disagree with out_features must fail
// here (a clear error) rather than there (memory outside the tensor).
at::Tensor checked_linear(const at::Tensor& x, const std::vector<OptT>& w, int64_t i, int64_t kind, int64_t out,
                          int64_t isa) {
  at::Tensor y = run_linear(x, w, i, kind, out, isa);
  TORCH_CHECK_VALUE(y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == out && y.scalar_type() == at::kFloat,
                    "decoder_layer: linear ", i, " gave ", y.sizes(), ", not [", x.size(0), ", out_features[", i,
                    "] = ", out, "] float32: its weight does not match out_features");
  return y.contiguous();
}

// RMSNorm of each row of x [rows, n] into out: x * (1 / sqrt(mean(x^2) + eps)) * w, the sum of
// squares taken in float64 in index order (each row alone, so rows stay independent).  The one
// definition of the engine's CPU float32 RMSNorm: the one-call layer and rms_norm (the
// Python layer's and the final norm's) both run it, so every path a pass takes rounds alike.
// Rows are split over threads; a row's arithmetic does not depend on the split.
float rms_inverse(const float* xr, int64_t n, double eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * double(xr[i]);
  return static_cast<float>(1.0 / std::sqrt(ss / double(n) + eps));
}

void rms_norm_row(const float* xr, const float* w, int64_t n, double eps, float* o) {
  const float inv = rms_inverse(xr, n, eps);
  for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] * inv) * w[i];
}

// The blocks b0 .. b1 - 1 of 32 elements (flat over rows of n, n a multiple of 32) of
// rms_norm_rows(x, w, rows, n, eps, out): each row's inverse from the whole row, its elements
// alone, so any cut of the blocks gives rms_norm_row's bits.
void rms_norm_blocks(const float* x, const float* w, int64_t n, double eps, float* out, int64_t b0, int64_t b1) {
  const int64_t per = n / 32;
  for (int64_t r = b0 / per; r * per < b1; ++r) {
    const float* xr = x + r * n;
    const float inv = rms_inverse(xr, n, eps);
    const int64_t e1 = std::min(b1 - r * per, per) * 32;
    for (int64_t i = std::max<int64_t>(b0 - r * per, 0) * 32; i < e1; ++i) out[r * n + i] = (xr[i] * inv) * w[i];
  }
}

void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t n, double eps, float* out) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(x + r * n, w, n, eps, out + r * n);
  });
}

// torch.ops.specdec_engine.rms_norm: RMSNorm over the last dimension of x [..., n] float32 CPU
// with weight [n] float32, by rms_norm_rows; returns a new float32 tensor of x's shape.
at::Tensor rms_norm_cpu(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  TORCH_CHECK_VALUE(x_in.dim() >= 1 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
                    "rms_norm: x must be float32 [..., n] on the CPU");
  const int64_t n = x_in.size(-1);
  TORCH_CHECK_VALUE(
      weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
      "rms_norm: weight must be float32 [n] on the CPU, n = x.size(-1) = ", n);
  const at::Tensor x = x_in.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t rows = n ? x.numel() / n : 0;
  if (rows) rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), rows, n, eps, out.data_ptr<float>());
  return out;
}

// SwiGLU's product of each row of gu [rows, 2 I]: out[r, i] = silu(g) * u with g = gu[r, i],
// u = gu[r, I + i], silu(g) = g * s, s = 1 / (1 + e) where g >= 0 and e / (1 + e) where g < 0,
// e = exp(-|g|) (exp8_nonpos: never overflows; relative error about 2e-7).  Each element alone, in
// one order of IEEE float32 operations, each rounded once, on every CPU: the AVX2 clone (AVX2
// without FMA: nothing is fused) and the baseline one (SSE, ten times slower: GCC splits the
// 8-float vectors through the stack) give the same bits.  nan gives nan, +inf inf, -inf nan (as
// torch's silu).  The one definition of the engine's CPU float32 SwiGLU: the one-call layer and
// silu_mul (below, the Python layer's) both run it.
SPECDEC_INLINE v8sf silu_mul8(v8sf g, v8sf u) {
  const v8sf zero = v8sf{0, 0, 0, 0, 0, 0, 0, 0}, one = zero + 1.0f;
  const v8sf e = exp8_nonpos(g < zero ? g : -g);  // exp(-|g|); nan stays nan
  return (g * ((g < zero ? e : one) / (one + e))) * u;
}

// silu_mul_rows' blocks b0 .. b1 - 1 of 32 outputs (flat over rows of I, I a multiple of 32): the
// same vectors of 8, so the same bits.
SPECDEC_TARGET_CLONES("avx2")
void silu_mul_blocks(const float* gu, int64_t I, float* out, int64_t b0, int64_t b1) {
  const int64_t per = I / 32;
  for (int64_t bl = b0; bl < b1; ++bl) {
    const int64_t r = bl / per, i0 = (bl % per) * 32;
    const float* g = gu + r * 2 * I + i0;
    float* o = out + r * I + i0;
    for (int64_t i = 0; i < 32; i += 8) store8(o + i, silu_mul8(load8(g + i), load8(g + I + i)));
  }
}

SPECDEC_TARGET_CLONES("avx2")
void silu_mul_rows(const float* gu, int64_t rows, int64_t I, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    float* o = out + r * I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) store8(o + i, silu_mul8(load8(g + i), load8(u + i)));
    if (i < I) {  // the last 1 to 7: through zero-padded copies (nothing read or written past the row)
      const int64_t n = I - i;
      float gb[8] = {}, ub[8] = {}, res[8];
      std::memcpy(gb, g + i, n * sizeof(float));
      std::memcpy(ub, u + i, n * sizeof(float));
      store8(res, silu_mul8(load8(gb), load8(ub)));
      std::memcpy(o + i, res, n * sizeof(float));
    }
  }
}

// torch.ops.specdec_engine.silu_mul: silu_mul_rows over gate_up float32 [..., 2 I] on the CPU;
// returns float32 [..., I].
at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  TORCH_CHECK_VALUE(gate_up.dim() >= 1 && gate_up.scalar_type() == at::kFloat && gate_up.device().is_cpu() &&
                        gate_up.size(-1) % 2 == 0,
                    "silu_mul: gate_up must be float32 [..., 2 I] on the CPU");
  const at::Tensor gu = gate_up.contiguous();
  const int64_t I = gu.size(-1) / 2;
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gu.options());
  const int64_t rows = I ? gu.numel() / (2 * I) : 0;
  if (rows) silu_mul_rows(gu.data_ptr<float>(), rows, I, out.data_ptr<float>());
  return out;
}

// Rotary embedding of one head row (model.rotate: x * cos + cat(-x[D/2:], x[:D/2]) * sin, each
// product and the sum rounded once, as the ATen ops do) into out, which may be a cache row.
inline void rotate_row(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -x[d + half] : x[d - half];
    const float a = x[d] * cos[d];
    const float b = rot * sin[d];
    out[d] = a + b;
  }
}

// The heads u0 .. u1 - 1 of a pass's qkv [rows, (H + 2 Hkv) D], unit u = row (H + Hkv) + h
// (row = b * N + i): for h < H, q's head h (plus its bias where bias is given: qkv's row is
// updated in place) rotated into q [rows, H, D]; for h = H + j, k's head j (plus bias) rotated
// into the cache and v's head j (plus bias) copied there, at slot cache_seqlens[b] + i
// (k_cache, v_cache [B, Hkv, S, D] with unit head-dim stride, their data moved by `offset`
// elements: another layer of a stacked cache).  Each head alone: any cut of the
// units gives the same bits.
void rotary_units(float* qkv, const float* bias, const float* cos, const float* sin, const int32_t* lens, int64_t N,
                  int64_t H, int64_t Hkv, int64_t D, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  int64_t offset, float* q, int64_t u0, int64_t u1) {
  float* kp = k_cache.data_ptr<float>() + offset;
  float* vp = v_cache.data_ptr<float>() + offset;
  const int64_t kb = k_cache.stride(0), kh = k_cache.stride(1), ks = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vh = v_cache.stride(1), vs = v_cache.stride(2);
  const int64_t width = (H + 2 * Hkv) * D;
  auto add_bias = [&](float* x, int64_t c0) {
    if (bias)
      for (int64_t d = 0; d < D; ++d) x[d] = x[d] + bias[c0 + d];
  };
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t row = u / (H + Hkv), h = u % (H + Hkv), b = row / N, i = row % N;
    float* r = qkv + row * width;
    const float* c = cos + row * D;
    const float* s = sin + row * D;
    if (h < H) {
      add_bias(r + h * D, h * D);
      rotate_row(r + h * D, c, s, D, q + (row * H + h) * D);
      continue;
    }
    const int64_t j = h - H, slot = lens[b] + i;
    add_bias(r + (H + j) * D, (H + j) * D);
    add_bias(r + (H + Hkv + j) * D, (H + Hkv + j) * D);
    rotate_row(r + (H + j) * D, c, s, D, kp + b * kb + j * kh + slot * ks);
    std::memcpy(vp + b * vb + j * vh + slot * vs, r + (H + Hkv + j) * D, D * sizeof(float));
  }
}

// Whether no two elements of t share memory (a sufficient condition on its sizes and strides:
// each stride, taken in increasing order, reaches past the whole extent of the smaller ones).
// A cache that fails it (a batch expanded with stride 0, slots closer than a row) would have
// two writes land in one place, in an order that depends on the threads.
bool no_self_overlap(const at::Tensor& t, std::vector<std::pair<int64_t, int64_t>> dims = {}) {
  // (stride, size) of the dimensions of size > 1 (and any given in dims)
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t extent = 0;  // the largest offset the smaller dimensions reach
  for (const auto& [stride, size] : dims) {
    if (stride <= extent) return false;
    extent += stride * (size - 1);
  }
  return true;
}

// Whether the keys and values of a layer's cache are disjoint from each other (each alone is
// no_self_overlap): in different storages; or laid out alike, the pair read as one tensor with
// a dimension of 2 at their distance; or, laid out otherwise, in disjoint ranges of memory.
bool disjoint_pair(const at::Tensor& k, const at::Tensor& v) {
  if (k.numel() == 0 || !k.storage().is_alias_of(v.storage())) return true;
  const int64_t ko = k.storage_offset(), vo = v.storage_offset();
  if (k.strides() == v.strides() && k.sizes() == v.sizes())
    return ko != vo && no_self_overlap(k, {{std::abs(vo - ko), 2}});
  auto last = [](const at::Tensor& t) {
    int64_t e = t.storage_offset();
    for (int64_t d = 0; d < t.dim(); ++d) e += std::max<int64_t>(t.size(d) - 1, 0) * t.stride(d);
    return e;
  };
  return last(k) < vo || last(v) < ko;
}

// Every linear of a layer checked before any runs: its kind, and its weight tensors' dtypes and
// shapes against its input size and out_features[i] (the checks of the product it runs), so
// that a bad layer fails before an earlier one writes its cache.
void check_linears(const std::vector<OptT>& w, at::IntArrayRef kinds, at::IntArrayRef out_features, int64_t hidden,
                   int64_t attn_width) {
  const int64_t in[4] = {hidden, attn_width, hidden, out_features[2] / 2};
  for (int64_t i = 0; i < 4; ++i) {
    const int64_t kind = kinds[i], O = out_features[i], I = in[i];
    TORCH_CHECK_VALUE(kind >= 0 && kind <= 5, "decoder_layer: kinds[", i, "] must lie in 0..5, got ", kind);
    const at::Tensor a = slot(w, i, 0);
    TORCH_CHECK_VALUE(a.device().is_cpu(), "decoder_layer: linear ", i, "'s weight tensors must be CPU tensors");
    if (kind >= 4) {
      const at::Tensor d = slot(w, i, 1);
      const OptT m = kind == 4 ? OptT(slot(w, i, 2).contiguous()) : c10::nullopt;
      int8_check(I, a.contiguous(), d.contiguous(), m, kind - 4, O);
    } else if (kind == 3) {
      TORCH_CHECK_VALUE(a.dim() == 2 && a.scalar_type() == at::kFloat && a.size(0) == O && a.size(1) == I,
                        "decoder_layer: linear ", i, "'s weight must be float32 [out_features[", i, "], ", I, "] = [",
                        O, ", ", I, "], got ", a.sizes(), " ", a.scalar_type());
    } else {
      TORCH_CHECK_VALUE(I % 32 == 0 && I > 0 && a.dim() == 2 &&
                            a.scalar_type() == (kind == 2 ? at::kFloat : at::kByte) && a.size(0) == O &&
                            a.size(1) == (kind == 0 ? I / 2 : I),
                        "decoder_layer: linear ", i, "'s codes must be ", kind == 2 ? "float32" : "uint8", " [", O,
                        ", ", kind == 0 ? I / 2 : I, "] (out_features[", i, "] by ", I,
                        " inputs, a multiple of 32), got ", a.sizes(), " ", a.scalar_type());
      if (kind < 2) {
        const at::Tensor sc = slot(w, i, 1);
        TORCH_CHECK_VALUE(sc.scalar_type() == at::kFloat && sc.dim() == 2 && sc.size(0) == O && sc.size(1) == I / 32 &&
                              sc.device().is_cpu(),
                          "decoder_layer: linear ", i, "'s scales must be float32 [", O, ", ", I / 32, "] on the CPU");
        if (kind == 0) {
          const at::Tensor mn = slot(w, i, 2);
          TORCH_CHECK_VALUE(mn.scalar_type() == at::kFloat && mn.sizes() == sc.sizes() && mn.device().is_cpu(),
                            "decoder_layer: linear ", i, "'s mins must be float32 [", O, ", ", I / 32, "] on the CPU");
        }
      }
    }
  }
}

// decoder_layer's checks of one layer's arguments (a stack checks every layer before any runs).
void check_layer(const at::Tensor& x_in, const at::Tensor& attn_norm, const at::Tensor& ffn_norm,
                 const at::Tensor& cos_in, const at::Tensor& sin_in, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const at::Tensor& cache_seqlens, const OptT& qkv_bias,
                 const std::vector<OptT>& weights, at::IntArrayRef kinds, at::IntArrayRef out_features,
                 int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK_VALUE(x_in.dim() == 3 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
                    "decoder_layer: x must be float32 [B, N, hidden] on the CPU");
  TORCH_CHECK_VALUE(weights.size() == 12 && kinds.size() == 4 && out_features.size() == 4,
                    "decoder_layer: needs 12 weight slots, 4 kinds and 4 out_features");
  const int64_t B = x_in.size(0), N = x_in.size(1), hidden = x_in.size(2);
  const int64_t H = num_heads, Hkv = num_kv_heads;
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B &&
                        k_cache.size(1) == Hkv && k_cache.scalar_type() == at::kFloat &&
                        v_cache.scalar_type() == at::kFloat && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
                    "decoder_layer: k_cache and v_cache must be float32 [B, Hkv, S, D] with unit head-dim stride");
  const int64_t S = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK_VALUE(H >= Hkv && Hkv >= 1 && H % Hkv == 0 && D % 2 == 0,
                    "decoder_layer: num_heads must be a multiple of num_kv_heads, and the head dim even");
  TORCH_CHECK_VALUE(out_features[0] == (H + 2 * Hkv) * D && out_features[1] == hidden && out_features[3] == hidden &&
                        out_features[2] % 2 == 0,
                    "decoder_layer: out_features do not fit the layer's shapes");
  TORCH_CHECK_VALUE(cos_in.numel() == B * N * D && sin_in.numel() == B * N * D && cos_in.scalar_type() == at::kFloat &&
                        sin_in.scalar_type() == at::kFloat,
                    "decoder_layer: cos and sin must be float32 [B, N, 1, D]");
  TORCH_CHECK_VALUE(attn_norm.numel() == hidden && ffn_norm.numel() == hidden &&
                        attn_norm.scalar_type() == at::kFloat && ffn_norm.scalar_type() == at::kFloat,
                    "decoder_layer: the norm weights must be float32 [hidden]");
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B && cache_seqlens.scalar_type() == at::kInt,
                    "decoder_layer: cache_seqlens must be int32 [B]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_cache, &v_cache, &cos_in, &sin_in, &attn_norm,
                                                                      &ffn_norm, &cache_seqlens})
    TORCH_CHECK_VALUE(t->device().is_cpu(),
                      "decoder_layer: the caches, cos, sin, the norm weights and cache_seqlens must be CPU tensors");
  TORCH_CHECK_VALUE(!given(qkv_bias) || (qkv_bias->dim() == 1 && qkv_bias->size(0) == out_features[0] &&
                                         qkv_bias->scalar_type() == at::kFloat && qkv_bias->device().is_cpu()),
                    "decoder_layer: qkv_bias must be None or float32 [(H + 2 Hkv) D] on the CPU");
  const at::Tensor lens = cache_seqlens.contiguous();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)  // every slot written lies inside the cache
    TORCH_CHECK_VALUE(lp[b] >= 0 && lp[b] + N <= S, "decoder_layer: cache_seqlens[", b, "] + N must lie in [N, S=", S,
                      "], got ", lp[b], " + ", N);
  TORCH_CHECK_VALUE(no_self_overlap(k_cache) && no_self_overlap(v_cache) && disjoint_pair(k_cache, v_cache),
                    "decoder_layer: k_cache and v_cache must hold every key and value (sequence, head, slot) in "
                    "memory of its own (a batch expanded with stride 0, keys that are the values, or slots closer "
                    "than a row, would write two entries in one place); got strides ",
                    k_cache.strides(), " and ", v_cache.strides());
  check_linears(weights, kinds, out_features, hidden, H * D);
}

// One layer on arguments check_layer has passed (decoder_layer_cpu checks them; decoder_stack_cpu
// checks every layer's before the first runs).
at::Tensor run_layer(const at::Tensor& x_in, const at::Tensor& attn_norm, const at::Tensor& ffn_norm, double eps,
                     const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& cache_seqlens, const OptT& tree_mask, const OptT& qkv_bias,
                     const std::vector<OptT>& weights, at::IntArrayRef kinds, at::IntArrayRef out_features,
                     int64_t num_heads, int64_t num_kv_heads, int64_t isa) {
  const int64_t B = x_in.size(0), N = x_in.size(1), hidden = x_in.size(2);
  const int64_t H = num_heads, Hkv = num_kv_heads, D = k_cache.size(3);
  const at::Tensor lens = cache_seqlens.contiguous();
  const int32_t* lp = lens.data_ptr<int32_t>();
  if (B == 0 || N == 0) return x_in.clone();
  const at::Tensor x = x_in.contiguous(), cs = cos_in.contiguous(), sn = sin_in.contiguous();
  const at::Tensor w_attn = attn_norm.contiguous(), w_ffn = ffn_norm.contiguous();
  const int64_t rows = B * N;
  const auto opts = x.options();

  at::Tensor xn = at::empty({rows, hidden}, opts);
  rms_norm_rows(x.data_ptr<float>(), w_attn.data_ptr<float>(), rows, hidden, eps, xn.data_ptr<float>());
  at::Tensor qkv = checked_linear(xn, weights, 0, kinds[0], out_features[0], isa);
  if (given(qkv_bias)) qkv = (qkv + *qkv_bias).contiguous();

  // rotary embedding of q and k; k and v written into the cache at slots cache_seqlens[b] + i
  at::Tensor q = at::empty({B, N, H, D}, opts);
  rotary_units(qkv.data_ptr<float>(), nullptr, cs.data_ptr<float>(), sn.data_ptr<float>(), lp, N, H, Hkv, D, k_cache,
               v_cache, 0, q.data_ptr<float>(), 0, rows * (H + Hkv));
  const at::Tensor attn = tree_attention(q, k_cache, v_cache, lens, tree_mask, std::pow(double(D), -0.5));
  at::Tensor h = checked_linear(attn.reshape({rows, H * D}), weights, 1, kinds[1], out_features[1], isa);
  {  // h = x + attention output (one rounding per element, as x + y)
    float* hp = h.data_ptr<float>();
    const float* xp = x.data_ptr<float>();
    for (int64_t e = 0; e < rows * hidden; ++e) hp[e] = xp[e] + hp[e];
  }
  at::Tensor hn = at::empty({rows, hidden}, opts);
  rms_norm_rows(h.data_ptr<float>(), w_ffn.data_ptr<float>(), rows, hidden, eps, hn.data_ptr<float>());
  const at::Tensor gu = checked_linear(hn, weights, 2, kinds[2], out_features[2], isa);
  const int64_t inter = out_features[2] / 2;
  at::Tensor act = at::empty({rows, inter}, opts);
  silu_mul_rows(gu.data_ptr<float>(), rows, inter, act.data_ptr<float>());
  at::Tensor out = checked_linear(act, weights, 3, kinds[3], out_features[3], isa);
  {
    float* o = out.data_ptr<float>();
    const float* hp = h.data_ptr<float>();
    for (int64_t e = 0; e < rows * hidden; ++e) o[e] = hp[e] + o[e];
  }
  return out.view({B, N, hidden});
}

at::Tensor decoder_layer_cpu(const at::Tensor& x_in, const at::Tensor& attn_norm, const at::Tensor& ffn_norm,
                             double eps, const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor k_cache,
                             at::Tensor v_cache, const at::Tensor& cache_seqlens, const OptT& tree_mask,
                             const OptT& qkv_bias, const std::vector<OptT>& weights, at::IntArrayRef kinds,
                             at::IntArrayRef out_features, int64_t num_heads, int64_t num_kv_heads, int64_t isa) {
  check_layer(x_in, attn_norm, ffn_norm, cos_in, sin_in, k_cache, v_cache, cache_seqlens, qkv_bias, weights, kinds,
              out_features, num_heads, num_kv_heads);
  return run_layer(x_in, attn_norm, ffn_norm, eps, cos_in, sin_in, k_cache, v_cache, cache_seqlens, tree_mask, qkv_bias,
                   weights, kinds, out_features, num_heads, num_kv_heads, isa);
}

// The int8 layers of a stack in one parallel region (decoder_stack_cpu, below): every product
// of every layer on the int8 path (kinds 4 and 5), and the whole pass run by one team of
// threads, with a barrier between its steps instead of a fork and a join of the thread pool
// per product, per quantisation and per attention (about ten per layer, 300 per pass of 30
// layers, each costing microseconds and stalling on any descheduled thread; issue #56).
//
// The steps of layer l, each split over the team's threads by a fixed rule (T nearly equal
// contiguous ranges of its units: blocks of 32 elements, groups of 8 output columns, heads or
// attention items), with a barrier after each, so that a pass of one token keeps every thread
// busy in every step:
//   1. blocks: RMSNorm of x (the input for layer 0, else the previous layer's h + y), quantised;
//   2. groups: qkv = product; 3. heads: the bias, the rotary embedding and the cache writes;
//   4. attention items (a sequence's 64-key splits, cut by their keys, so that one sequence's
//      attention runs on every thread); 5. query heads (rows where a head is not whole blocks
//      of 32): the splits' outputs combined, quantised;
//   6. groups: y = wo's product, and h = x + y over the same columns; 7. blocks: RMSNorm of h,
//   quantised; 8. groups: gate and up; 9. blocks: SwiGLU, quantised;
//   10. groups: y = w2's product, and h + y over the same columns (the next layer's x, or the
//   output).
// Every element is computed by the loops the one-layer op runs (rms_norm_row's inverse and
// products, int8_quantize and int8_groups, rotary_units, dense_attention_items and _finish,
// silu_mul8, the residual adds), each block, group, head and item alone, so the region gives
// the bits of L decoder_layer calls at any thread count (tested).
// Every argument of every layer is checked before the region starts (decoder_stack_cpu does,
// on either path): nothing in it throws, and a bad layer fails before any cache is written.
bool all_int8(at::IntArrayRef kinds) {
  for (int64_t k : kinds)
    if (k != 4 && k != 5) return false;
  return !kinds.empty();
}

at::Tensor decoder_stack_region(const at::Tensor& x_in, at::TensorList norms, double eps, const at::Tensor& cos_in,
                                const at::Tensor& sin_in, const at::Tensor& k0, const at::Tensor& v0,
                                int64_t layer_stride, const at::Tensor& cache_seqlens, const OptT& tree_mask,
                                const std::vector<OptT>& qkv_biases, const std::vector<OptT>& weights,
                                at::IntArrayRef kinds, at::IntArrayRef out_features, int64_t num_heads,
                                int64_t num_kv_heads, int64_t isa) {
  const int64_t L = static_cast<int64_t>(qkv_biases.size());
  // every layer's arguments were checked by decoder_stack_cpu; layer l's caches are k0 and v0
  // moved by l layer_stride elements
  std::vector<at::Tensor> keep;
  std::vector<Int8Weight> w(4 * L);
  keep.reserve(13 * L);  // up to 12 weights and a bias a layer: references into it stay valid
  const int64_t B = x_in.size(0), N = x_in.size(1), hidden = x_in.size(2);
  const int64_t H = num_heads, Hkv = num_kv_heads, D = k0.size(3), rows = B * N;
  if (B == 0 || N == 0) return x_in.clone();
  int64_t inter = 0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t in[4] = {hidden, H * D, hidden, out_features[4 * l + 2] / 2};
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t slot0 = 12 * l + 3 * i;  // weights checked by check_linears: kept contiguous here
      auto kept = [&](const OptT& t) -> const at::Tensor& { return keep.emplace_back(t->contiguous()); };
      const at::Tensor& qw = kept(weights[slot0]);
      const at::Tensor& dw = kept(weights[slot0 + 1]);
      const OptT mw = kinds[4 * l + i] == 4 ? OptT(kept(weights[slot0 + 2])) : c10::nullopt;
      w[4 * l + i] = int8_check(in[i], qw, dw, mw, kinds[4 * l + i] - 4, out_features[4 * l + i]);
    }
    inter = std::max(inter, out_features[4 * l + 2] / 2);
  }
  const int64_t path = int8_path(isa);
  const int64_t team = at::in_parallel_region() ? 1 : std::max<int64_t>(1, at::get_num_threads());
  const auto opts = x_in.options();
  at::Tensor q = at::empty({B, N, H, D}, opts), attn = at::empty({B, N, H, D}, opts);
  DenseAttention att = dense_attention_prepare(q, k0, v0, cache_seqlens, tree_mask, team);
  const at::Tensor x = x_in.contiguous(), cs = cos_in.contiguous(), sn = sin_in.contiguous();
  const at::Tensor lens = cache_seqlens.contiguous();
  std::vector<at::Tensor> nw(2 * L);
  std::vector<const float*> bias(L, nullptr);
  for (int64_t l = 0; l < L; ++l) {
    nw[2 * l] = norms[2 * l].contiguous();
    nw[2 * l + 1] = norms[2 * l + 1].contiguous();
    if (given(qkv_biases[l])) keep.push_back(qkv_biases[l]->contiguous()), bias[l] = keep.back().data_ptr<float>();
  }
  const int64_t width = (H + 2 * Hkv) * D;
  at::Tensor out = at::empty({B, N, hidden}, opts), h = at::empty({rows, hidden}, opts),
             y = at::empty({rows, hidden}, opts), xn = at::empty({rows, hidden}, opts),
             qkv = at::empty({rows, width}, opts), gu = at::empty({rows, 2 * inter}, opts),
             act = at::empty({rows, inter}, opts);
  QuantX qx;
  int8_reserve(qx, rows, std::max({hidden, H * D, inter}));
  float *op = out.data_ptr<float>(), *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>(), *xnp = xn.data_ptr<float>(),
        *qkvp = qkv.data_ptr<float>(), *gup = gu.data_ptr<float>(), *actp = act.data_ptr<float>(),
        *qp = q.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *cp = cs.data_ptr<float>(), *sp = sn.data_ptr<float>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const double scale = std::pow(double(D), -0.5);
  const bool head_units = D % 32 == 0;

  // one thread's part of the pass (tid of T)
  auto run = [&](int64_t tid, int64_t T) {
    // [n tid / T, n (tid + 1) / T): the same cut for every step over n items
    auto part = [&](int64_t n, auto&& f) {
      const int64_t a = n * tid / T, b = n * (tid + 1) / T;
      if (a < b) f(a, b);
    };
    auto sync = [&] {
      if (T > 1) {
#pragma omp barrier
      }
    };
    // a product by groups of 8 output columns; then, where `sum` is given, sum[., c] = add[., c] +
    // dst[., c] over the same columns (the residual adds, each element alone)
    auto product = [&](int64_t l, int64_t i, float* dst, float* sum = nullptr, const float* add = nullptr) {
      const Int8Weight& wi = w[4 * l + i];
      part(wi.G, [&](int64_t g0, int64_t g1) {
        int8_groups(path, wi, qx, rows, dst, g0, g1);
        if (sum)
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = r * wi.O + 8 * g0; c < r * wi.O + std::min(8 * g1, wi.O); ++c) sum[c] = add[c] + dst[c];
      });
      sync();
    };
    const int64_t nb = hidden / 32;  // blocks of 32 a row of the hidden size
    for (int64_t l = 0; l < L; ++l) {
      const float* xl = l == 0 ? xp : op;  // this layer's input (h + y of the previous layer, step 10)
      const float* wa = nw[2 * l].data_ptr<float>();
      const float* wf = nw[2 * l + 1].data_ptr<float>();
      part(rows * nb, [&](int64_t b0, int64_t b1) {  // 1
        rms_norm_blocks(xl, wa, hidden, eps, xnp, b0, b1);
        int8_quantize(path, xnp, b0, b1, qx);
      });
      sync();
      product(l, 0, qkvp);                                  // 2
      part(rows * (H + Hkv), [&](int64_t u0, int64_t u1) {  // 3
        rotary_units(qkvp, bias[l], cp, sp, lp, N, H, Hkv, D, k0, v0, l * layer_stride, qp, u0, u1);
      });
      sync();
      {  // 4
        int64_t i0, i1;
        att.splits->range(tid, T, &i0, &i1);
        dense_attention_items(q, k0, v0, l * layer_stride, att, scale, i0, i1);
      }
      sync();
      // 5: by heads when a head's outputs are whole blocks of 32 (their quantisation then
      // needs no other head), else by rows
      part(head_units ? rows * H : rows, [&](int64_t u0, int64_t u1) {
        const int64_t per = head_units ? 1 : H;  // heads a unit
        dense_attention_finish(att, attn, u0 * per, u1 * per);
        int8_quantize(path, attn.data_ptr<float>(), u0 * per * D / 32, u1 * per * D / 32, qx);
      });
      sync();
      product(l, 1, yp, hp, xl);                     // 6, and h = x + y
      part(rows * nb, [&](int64_t b0, int64_t b1) {  // 7
        rms_norm_blocks(hp, wf, hidden, eps, xnp, b0, b1);
        int8_quantize(path, xnp, b0, b1, qx);
      });
      sync();
      product(l, 2, gup);  // 8
      const int64_t I = out_features[4 * l + 2] / 2;
      part(rows * (I / 32), [&](int64_t b0, int64_t b1) {  // 9
        silu_mul_blocks(gup, I, actp, b0, b1);
        int8_quantize(path, actp, b0, b1, qx);
      });
      sync();
      product(l, 3, yp, op, hp);  // 10, and the next layer's input (or the output) h + y
    }
  };
#ifdef _OPENMP
  if (team > 1) {
#pragma omp parallel num_threads(team)
    run(omp_get_thread_num(), omp_get_num_threads());
    return out;
  }
#endif
  run(0, 1);
  return out;
}

// torch.ops.specdec_engine.decoder_stack: the layers 0 .. L - 1 of a pass in one call, layer l
// being decoder_layer_cpu with norms[2 l], norms[2 l + 1], qkv_biases[l], weights[12 l .. 12 l + 11],
// kinds and out_features[4 l .. 4 l + 3], and the caches kv_cache[l][0], kv_cache[l][1]
// (kv_cache [L', 2, B, Hkv, S, D], L' >= L, written in place).  The same bits as L calls of
// decoder_layer, without a return to Python between layers: where every product is on the int8
// path, in one parallel region (decoder_stack_region), else by those calls in order.
at::Tensor decoder_stack_cpu(const at::Tensor& x_in, at::TensorList norms, double eps, const at::Tensor& cos,
                             const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& cache_seqlens,
                             const OptT& tree_mask, const std::vector<OptT>& qkv_biases,
                             const std::vector<OptT>& weights, at::IntArrayRef kinds, at::IntArrayRef out_features,
                             int64_t num_heads, int64_t num_kv_heads, int64_t isa) {
  const int64_t L = static_cast<int64_t>(qkv_biases.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(norms.size()) == 2 * L && static_cast<int64_t>(weights.size()) == 12 * L &&
                        static_cast<int64_t>(kinds.size()) == 4 * L &&
                        static_cast<int64_t>(out_features.size()) == 4 * L,
                    "decoder_stack: L layers need 2 L norms, L qkv_biases, 12 L weight slots, 4 L kinds and 4 L "
                    "out_features");
  TORCH_CHECK_VALUE(kv_cache.dim() == 6 && kv_cache.size(0) >= L && kv_cache.size(1) == 2,
                    "decoder_stack: kv_cache must be [L' >= L, 2, B, Hkv, S, D]");
  TORCH_CHECK_VALUE(no_self_overlap(kv_cache.narrow(0, 0, L)),
                    "decoder_stack: kv_cache must hold every (layer, key or value, sequence, head, slot) in memory "
                    "of its own (an expanded batch or key/value dimension would write two entries in one place); "
                    "got strides ",
                    kv_cache.strides());
  // every layer checked before any runs (and writes its cache); the layers' caches have layer 0's
  // sizes and strides, so its views stand for each (what the checks read of a cache, apart from
  // the overlap of the layers, checked above, does not change when the data moves by a layer)
  const at::Tensor k0 = L > 0 ? kv_cache.select(0, 0).select(0, 0) : at::Tensor();
  const at::Tensor v0 = L > 0 ? kv_cache.select(0, 0).select(0, 1) : at::Tensor();
  for (int64_t l = 0; l < L; ++l) {
    const std::vector<OptT> w(weights.begin() + 12 * l, weights.begin() + 12 * (l + 1));
    check_layer(x_in, norms[2 * l], norms[2 * l + 1], cos, sin, k0, v0, cache_seqlens, qkv_biases[l], w,
                kinds.slice(4 * l, 4), out_features.slice(4 * l, 4), num_heads, num_kv_heads);
  }
  if (L > 0 && all_int8(kinds))
    return decoder_stack_region(x_in, norms, eps, cos, sin, k0, v0, kv_cache.stride(0), cache_seqlens, tree_mask,
                                qkv_biases, weights, kinds, out_features, num_heads, num_kv_heads, isa);
  at::Tensor x = x_in;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor layer = kv_cache.select(0, l);
    const std::vector<OptT> w(weights.begin() + 12 * l, weights.begin() + 12 * (l + 1));
    x = run_layer(x, norms[2 * l], norms[2 * l + 1], eps, cos, sin, layer.select(0, 0), layer.select(0, 1),
                  cache_seqlens, tree_mask, qkv_biases[l], w, kinds.slice(4 * l, 4), out_features.slice(4 * l, 4),
                  num_heads, num_kv_heads, isa);
  }
  return L ? x : x_in.clone();
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec_engine, CPU, m) {
  m.impl("decoder_stack", &specdec::decoder_stack_cpu);
  m.impl("decoder_layer", &specdec::decoder_layer_cpu);
  m.impl("rms_norm", &specdec::rms_norm_cpu);
  m.impl("silu_mul", &specdec::silu_mul_cpu);
}
