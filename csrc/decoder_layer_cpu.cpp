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
void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t n, double eps, float* out) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * n;
      double ss = 0.0;
      for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * double(xr[i]);
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / double(n) + eps));
      float* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] * inv) * w[i];
    }
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

at::Tensor decoder_layer_cpu(const at::Tensor& x_in, const at::Tensor& attn_norm, const at::Tensor& ffn_norm,
                             double eps, const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor k_cache,
                             at::Tensor v_cache, const at::Tensor& cache_seqlens, const OptT& tree_mask,
                             const OptT& qkv_bias, const std::vector<OptT>& weights, at::IntArrayRef kinds,
                             at::IntArrayRef out_features, int64_t num_heads, int64_t num_kv_heads, int64_t isa) {
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
  {
    const float* src = qkv.data_ptr<float>();
    const float* cp = cs.data_ptr<float>();
    const float* sp = sn.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    float* kp = k_cache.data_ptr<float>();
    float* vp = v_cache.data_ptr<float>();
    const int64_t kb = k_cache.stride(0), kh = k_cache.stride(1), ks = k_cache.stride(2);
    const int64_t vb = v_cache.stride(0), vh = v_cache.stride(1), vs = v_cache.stride(2);
    const int64_t width = (H + 2 * Hkv) * D;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < N; ++i) {
        const int64_t row = b * N + i;
        const float* r = src + row * width;
        const float* c = cp + row * D;
        const float* s = sp + row * D;
        for (int64_t h = 0; h < H; ++h) rotate_row(r + h * D, c, s, D, qp + (row * H + h) * D);
        const int64_t slot = lp[b] + i;
        for (int64_t h = 0; h < Hkv; ++h) {
          rotate_row(r + (H + h) * D, c, s, D, kp + b * kb + h * kh + slot * ks);
          std::memcpy(vp + b * vb + h * vh + slot * vs, r + (H + Hkv + h) * D, D * sizeof(float));
        }
      }
  }
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

// torch.ops.specdec_engine.decoder_stack: the layers 0 .. L - 1 of a pass in one call, layer l
// being decoder_layer_cpu with norms[2 l], norms[2 l + 1], qkv_biases[l], weights[12 l .. 12 l + 11],
// kinds and out_features[4 l .. 4 l + 3], and the caches kv_cache[l][0], kv_cache[l][1]
// (kv_cache [L', 2, B, Hkv, S, D], L' >= L, written in place).  The same calls in the same order as
// L calls of decoder_layer (the same bits), without a return to Python between layers.
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
  at::Tensor x = x_in;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor layer = kv_cache.select(0, l);
    const std::vector<OptT> w(weights.begin() + 12 * l, weights.begin() + 12 * (l + 1));
    x = decoder_layer_cpu(x, norms[2 * l], norms[2 * l + 1], eps, cos, sin, layer.select(0, 0), layer.select(0, 1),
                          cache_seqlens, tree_mask, qkv_biases[l], w, kinds.slice(4 * l, 4),
                          out_features.slice(4 * l, 4), num_heads, num_kv_heads, isa);
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
