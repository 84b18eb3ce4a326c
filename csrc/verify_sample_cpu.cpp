// CPU fast paths of the verification and sampling ops: one pass over each sequence's rows,
// parallel over sequences (at::parallel_for), no intermediate [B, K + 1, V] tensors.
//
// Each kernel implements the algorithm of its reference in specdec_kernels/reference/ with the
// same arithmetic: accept tests in float32 as `u * q < p`, residual weights max(0, p - q) in
// float32 then widened, inverse-CDF sampling over a sequential float64 running sum (what torch's
// CPU cumsum does), argmax with torch.argmax's rule (first maximum, NaN counts as the maximum).  Row totals are
// sequential float64 sums, where the reference uses torch.sum, so a decision can differ only when a test lies within
// float64 rounding of its boundary.
//
// Inputs are validated by the Python op (specdec_kernels/ops/<op>.py).  The [.., V] score and
// probability tensors are read in place through their strides (views, slices, transposes and
// expanded stride-0 dimensions alike: `Rows` below), never copied into a contiguous tensor; a
// row whose elements are not adjacent is gathered into a per-thread V-element buffer.  The small
// per-sequence operands (tokens, counts, coins) are converted to int64 / float32.  Every count
// and index used as an address is clamped here, whatever was validated: no kernel reads or
// writes outside its tensors.
//
// Accumulation: every sum over a vocabulary row is a float64 sum (sequential, a fixed order:
// bit-identical call to call and independent of the other rows), so at V = 128k its relative
// error stays below 1e-11, as in the references (docs/API.md, "Tolerances").
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

// Every multiply rounds on its own, as the reference's separate PyTorch ops do: on a target
// with FMA (aarch64, x86 built with -march=native or -mfma) GCC and clang would otherwise
// contract `r * inv - q` into one fused multiply-add (GCC even with -std=c++17), which rounds
// once and can change a residual's zero/non-zero test.  Our code only: after the includes.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace specdec {
namespace {

template <typename T>
inline float f32(T v) {
  return static_cast<float>(v);
}

// A tensor of shape [..., V] (at most 3 leading dimensions) with any strides, read in place as
// [rows, V]: row r is r unravelled over the leading dimensions in row-major order, element i of
// it lies at row(r)[i * inner].  Nothing is copied, so an expanded (stride-0) input costs no
// memory: all its rows are the same few bytes.
template <typename T>
struct Rows {
  const T* base = nullptr;
  int64_t nlead = 0, V = 0, inner = 1;
  int64_t size[3] = {1, 1, 1}, stride[3] = {0, 0, 0};

  Rows() = default;
  explicit Rows(const at::Tensor& t) : base(t.data_ptr<T>()), nlead(t.dim() - 1), V(t.size(-1)), inner(t.stride(-1)) {
    TORCH_CHECK_VALUE(t.dim() >= 1 && t.dim() <= 4, "expected a tensor of 1 to 4 dimensions, got ", t.dim());
    for (int64_t d = 0; d < nlead; ++d) {
      size[d] = t.size(d);
      stride[d] = t.stride(d);
    }
  }
  const T* row(int64_t r) const {
    int64_t off = 0;
    for (int64_t d = nlead - 1; d >= 0; --d) {
      off += (r % size[d]) * stride[d];
      r /= size[d];
    }
    return base + off;
  }
  T at(int64_t r, int64_t i) const { return row(r)[i * inner]; }
  // Row r with adjacent elements: in place when they are (inner == 1), else gathered into
  // `scratch` (resized to V).
  const T* contiguous_row(int64_t r, std::vector<T>& scratch) const {
    const T* p = row(r);
    if (inner == 1) return p;
    scratch.resize(static_cast<size_t>(V));
    for (int64_t i = 0; i < V; ++i) scratch[i] = p[i * inner];
    return scratch.data();
  }
};

// A small per-sequence operand [B, X] (tokens, parents, coins) as a contiguous tensor of `dtype`
// and its row stride in elements: 0 when every row is the same (a stride-0 batch dimension, or a
// 1-D operand shared by the batch), which is then converted once, not B times.
std::pair<at::Tensor, int64_t> per_sequence(const at::Tensor& t, at::ScalarType dtype) {
  const at::Tensor one = t.dim() == 2 && t.size(0) > 0 && t.stride(0) == 0 ? t.select(0, 0) : t;
  const at::Tensor c = one.to(dtype).contiguous();
  return {c, c.dim() == 2 ? c.size(1) : 0};
}

inline double mass(double x) { return x > 0 ? x : 0.0; }  // NaN and negatives carry no mass

// Inverse-CDF sample of one token from non-negative double weights w[0..V) (the reference's
// sample_from_weights): the first index whose running sum exceeds u * total; the last index
// with mass if rounding puts the threshold at or past the total; 0 for a row without mass.
int64_t sample_weights(const std::vector<double>& w, double u) {
  const int64_t V = static_cast<int64_t>(w.size());
  double total = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < V; ++i) {
    total += w[i];
    if (w[i] > 0) last = i;
  }
  if (!(total > 0)) return 0;
  const double threshold = u * total;
  double c = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    c += w[i];
    if (c > threshold) return i;
  }
  return last;
}

// The maximum of a float32 row over its non-NaN values, in 16 independent lanes the compiler
// vectorizes (std::max keeps the lane on NaN), and whether the row holds a NaN or an infinity
// (v * 0 is NaN exactly then).
SPECDEC_TARGET_CLONES("avx2") float row_max_f32(const float* row, int64_t V, bool* special) {
  constexpr int64_t L = 16;
  float mx[L], nn[L];
  for (int64_t l = 0; l < L; ++l) {
    mx[l] = -std::numeric_limits<float>::infinity();
    nn[l] = 0.0f;
  }
  int64_t i = 0;
  for (; i + L <= V; i += L) {
    for (int64_t l = 0; l < L; ++l) {
      const float v = row[i + l];
      mx[l] = std::max(mx[l], v);
      nn[l] += v * 0.0f;
    }
  }
  float m = -std::numeric_limits<float>::infinity(), n = 0.0f;
  for (int64_t l = 0; l < L; ++l) {
    m = std::max(m, mx[l]);
    n += nn[l];
  }
  for (; i < V; ++i) {
    m = std::max(m, row[i]);
    n += row[i] * 0.0f;
  }
  *special = n != n;
  return m;
}

// The first index j with !(row[j] < m), blocks of 64 tested with a vectorized OR; -1 if none.
SPECDEC_TARGET_CLONES("avx2") int64_t first_not_below_f32(const float* row, int64_t V, float m) {
  constexpr int64_t BL = 64;
  int64_t b = 0;
  for (; b + BL <= V; b += BL) {
    int hit = 0;
    for (int64_t j = b; j < b + BL; ++j) hit |= !(row[j] < m);
    if (!hit) continue;
    for (int64_t j = b; j < b + BL; ++j)
      if (!(row[j] < m)) return j;
  }
  for (int64_t j = b; j < V; ++j)
    if (!(row[j] < m)) return j;
  return -1;
}

// torch.argmax of one row (first maximum; NaN counts as the maximum, the first NaN wins).
// The exact scalar rule, for any dtype and any row:
template <typename T>
int64_t row_argmax_exact(const T* row, int64_t V) {
  int64_t best = 0;
  float bv = f32(row[0]);
  if (bv != bv) return 0;
  for (int64_t i = 1; i < V; ++i) {
    const float v = f32(row[i]);
    if (v != v) return i;
    if (v > bv) {
      bv = v;
      best = i;
    }
  }
  return best;
}

#ifdef SPECDEC_X86
// One AVX2 pass: 16 lanes each keep their maximum and the index where it first appeared (updated
// only on a strictly greater value), then the largest value's smallest index among the lanes and
// the scalar tail.  That is the first maximum when the row has no NaN or infinity; `special`
// (v * 0 summed: NaN exactly then) sends other rows to the exact loop.  V < 2^31 (int32 lanes).
__attribute__((target("avx2"))) int64_t row_argmax_f32_avx2(const float* row, int64_t V, bool* special) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 mx0 = neg_inf, mx1 = neg_inf, nn = _mm256_setzero_ps();
  __m256i ix0 = _mm256_setzero_si256(), ix1 = _mm256_setzero_si256();
  __m256i at0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at1 = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i step = _mm256_set1_epi32(16);
  const __m256 zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(row + i), v1 = _mm256_loadu_ps(row + i + 8);
    const __m256 g0 = _mm256_cmp_ps(v0, mx0, _CMP_GT_OQ), g1 = _mm256_cmp_ps(v1, mx1, _CMP_GT_OQ);
    mx0 = _mm256_blendv_ps(mx0, v0, g0);
    mx1 = _mm256_blendv_ps(mx1, v1, g1);
    ix0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(ix0), _mm256_castsi256_ps(at0), g0));
    ix1 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(ix1), _mm256_castsi256_ps(at1), g1));
    nn = _mm256_add_ps(nn, _mm256_add_ps(_mm256_mul_ps(v0, zero), _mm256_mul_ps(v1, zero)));
    at0 = _mm256_add_epi32(at0, step);
    at1 = _mm256_add_epi32(at1, step);
  }
  alignas(32) float m[16], n[8];
  alignas(32) int32_t x[16];
  _mm256_store_ps(m, mx0);
  _mm256_store_ps(m + 8, mx1);
  _mm256_store_si256(reinterpret_cast<__m256i*>(x), ix0);
  _mm256_store_si256(reinterpret_cast<__m256i*>(x + 8), ix1);
  _mm256_store_ps(n, nn);
  float bv = -std::numeric_limits<float>::infinity(), nsum = 0.0f;
  int64_t best = -1;
  for (int l = 0; l < 16; ++l) {
    if (i == 0) break;  // no full group: the lanes hold nothing
    if (m[l] > bv || (m[l] == bv && x[l] < best)) {
      bv = m[l];
      best = x[l];
    }
  }
  for (int l = 0; l < 8; ++l) nsum += n[l];
  for (; i < V; ++i) {  // the tail's indices come after every lane's
    nsum += row[i] * 0.0f;
    if (row[i] > bv || best < 0) {
      bv = row[i];
      best = i;
    }
  }
  *special = nsum != nsum;
  return best < 0 ? 0 : best;
}
#endif

// Fast float32 path: without NaN or infinities, one AVX2 pass tracking each lane's first
// maximum where the CPU has AVX2, else the first index not below the maximum (about 1.5
// vectorized passes); at::argmax is a scalar index-tracking loop, several times slower on a
// 49152-wide row.  Rows with NaN or an infinity take the exact loop.
template <typename T>
int64_t row_argmax(const T* row, int64_t V) {
  if constexpr (std::is_same_v<T, float>) {
    bool special = false;
#ifdef SPECDEC_X86
    if (cpu_has_avx2() && V < (int64_t{1} << 31)) {
      const int64_t j = row_argmax_f32_avx2(row, V, &special);
      if (!special) return j;
      return row_argmax_exact(row, V);
    }
#endif
    const float m = row_max_f32(row, V, &special);
    if (!special) {
      const int64_t j = first_not_below_f32(row, V, m);
      return j >= 0 ? j : 0;
    }
  }
  return row_argmax_exact(row, V);
}

// argmax of every row of a [..., V] tensor (any strides, read in place) into idx, parallel over
// rows.  A row at the same address as the previous one (an expanded dimension) holds the same
// values: its argmax is reused, not recomputed.
at::Tensor rows_argmax(const at::Tensor& logits) {
  const int64_t V = logits.size(-1), rows = V ? logits.numel() / V : 0;
  at::Tensor idx = at::empty({rows}, logits.options().dtype(at::kLong));
  if (rows == 0) return idx;
  int64_t* out = idx.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "rows_argmax", [&] {
    const Rows<scalar_t> x(logits);
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(V, 1));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> scratch;
      const scalar_t* last = nullptr;
      int64_t last_idx = 0;
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* p = x.row(r);
        if (p != last) {
          last = p;
          last_idx = row_argmax(x.contiguous_row(r, scratch), V);
        }
        out[r] = last_idx;
      }
    });
  });
  return idx;
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor");
}

// ------------------------------------------------------------------------ random numbers
// Philox4x32-10 (Salmon et al. 2011) as specdec_kernels/_random.py defines the ops' counter-based
// numbers: key (lo32(seed), hi32(seed)), counter (lo32(pos), hi32(pos), stream, 0); the first
// output word w gives (w >> 8) * 2^-24, a float32 in [0, 1).  `pos` wraps modulo 2^64, as the
// reference's int64 arithmetic does.
inline float philox_uniform(uint64_t seed, uint64_t pos, uint32_t stream) {
  uint32_t c0 = static_cast<uint32_t>(pos), c1 = static_cast<uint32_t>(pos >> 32), c2 = stream, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return static_cast<float>(c0 >> 8) * 0x1p-24f;
}

// A uniform made safe as specdec_kernels.checks.clamp_uniforms does: NaN as 0, clamped into
// [0, 1 - 2^-24] (the largest float32 below 1), whatever the caller passed or validated.
inline float safe_uniform(float u) {
  constexpr float kBelowOne = 1.0f - 0x1p-24f;
  if (!(u >= 0.0f)) return 0.0f;  // NaN and negatives
  return u < kBelowOne ? u : kBelowOne;
}

// Where a sampling kernel's uniforms come from: the explicit coins / sample uniforms (float32,
// contiguous) when given, else Philox from the request's seed and offset (stream 0 at
// offset + j for coin j, stream 1 at offset for the sample uniform).  Owns the converted tensors.
struct Uniforms {
  at::Tensor coins_t, final_t, seeds_t, offsets_t;
  bool explicit_coins = false, explicit_final = false;  // else Philox stream 0 / stream 1
  const float* coins = nullptr;                         // (an empty tensor's data pointer may be null)
  const float* final_u = nullptr;
  const int64_t* seeds = nullptr;
  const int64_t* offsets = nullptr;

  Uniforms(const c10::optional<at::Tensor>& uniform_samples, const c10::optional<at::Tensor>& sample_uniforms,
           const c10::optional<at::Tensor>& seeds_arg, const c10::optional<at::Tensor>& offsets_arg, int64_t batch,
           int64_t num_coins) {
    if (given(uniform_samples)) {
      TORCH_CHECK_VALUE(uniform_samples->numel() == num_coins, "uniform_samples must hold ", num_coins, " coins");
      coins_t = uniform_samples->to(at::kFloat).contiguous();
      coins = coins_t.data_ptr<float>();
      explicit_coins = true;
    }
    if (given(sample_uniforms)) {
      TORCH_CHECK_VALUE(sample_uniforms->numel() == batch, "sample_uniforms must be [B]");
      final_t = sample_uniforms->to(at::kFloat).contiguous();
      final_u = final_t.data_ptr<float>();
      explicit_final = true;
    }
    if (!explicit_coins || !explicit_final) {
      TORCH_CHECK_VALUE(given(seeds_arg) && given(offsets_arg),
                        "uniform_samples and sample_uniforms, or seeds and offsets for the missing ones, are needed");
      TORCH_CHECK_VALUE(seeds_arg->numel() == batch && offsets_arg->numel() == batch, "seeds and offsets must be [B]");
      seeds_t = seeds_arg->to(at::kLong).contiguous();
      offsets_t = offsets_arg->to(at::kLong).contiguous();
      check_cpu(seeds_t, "seeds");
      check_cpu(offsets_t, "offsets");
      seeds = seeds_t.data_ptr<int64_t>();
      offsets = offsets_t.data_ptr<int64_t>();
    }
  }
  // Coin j of request b; `index`: its place in the explicit coins.
  float coin(int64_t b, int64_t index, int64_t j) const {
    if (explicit_coins) return safe_uniform(coins[index]);
    const uint64_t pos = static_cast<uint64_t>(offsets[b]) + static_cast<uint64_t>(j);
    return safe_uniform(philox_uniform(static_cast<uint64_t>(seeds[b]), pos, 0));
  }
  // The uniform of request b's sampled token.
  float final(int64_t b) const {
    if (explicit_final) return safe_uniform(final_u[b]);
    return safe_uniform(philox_uniform(static_cast<uint64_t>(seeds[b]), static_cast<uint64_t>(offsets[b]), 1));
  }
};

// ------------------------------------------------------------------ flattened (vLLM v1) layout
// Request b's drafts in the flattened layout (specdec_kernels/_flattened.py): flat positions
// start .. start + n - 1, with start = clamp(cu[b - 1], 0, T) (0 for b = 0), end = clamp(cu[b],
// 0, T), n = clamp(end - start, 0, K): every row derived from a span lies inside its tensor
// whatever cu_num_draft_tokens holds (start + n <= end <= T).
struct Span {
  int64_t start, n;
};

inline Span flat_span(const int64_t* cu, int64_t b, int64_t num_tokens, int64_t K) {
  const int64_t start = b == 0 ? 0 : clamp64(cu[b - 1], 0, num_tokens);
  const int64_t end = clamp64(cu[b], 0, num_tokens);
  return {start, clamp64(end - start, 0, K)};
}

// Where request b's rows are, in units of rows.  Padded: target rows from b * (K + 1), draft
// rows, tokens and coins from b * K, count counts[b].  Flattened: draft rows, tokens and coins
// from start_b (coins from b * K when given padded, [B, K]); target rows from start_b + b (each
// request's bonus row inline) or start_b (the bonus tokens given as ids).
struct ChainLayout {
  const int64_t* counts;  // padded: [B] draft counts; flattened: cu_num_draft_tokens [B]
  int64_t K, num_tokens;
  bool flat, bonus_rows, padded_coins = false;
  struct Rows {
    int64_t target_row, draft_row, n;  // draft_row also indexes the tokens
    int64_t coin_row;                  // the first coin
  };
  Rows at(int64_t b) const {
    if (!flat) return {b * (K + 1), b * K, clamp64(counts[b], 0, K), b * K};
    const Span s = flat_span(counts, b, num_tokens, K);
    return {s.start + (bonus_rows ? b : 0), s.start, s.n, padded_coins ? b * K : s.start};
  }
};

// ------------------------------------------------------------------------------ verify_greedy
// One chain's greedy walk: accept drafts while they equal their row's argmax, then write the
// argmax at the first mismatch, or after n accepted drafts the bonus: the argmax of the row
// after the last draft, or *bonus when the caller gives the bonus token (that row is then not
// read, it need not exist).  Writes out[0..a]; returns a.
inline int64_t greedy_chain(const int64_t* argmax, const int64_t* drafts, int64_t n, const int64_t* bonus,
                            int64_t* out) {
  int64_t a = 0;
  while (a < n && drafts[a] == argmax[a]) {
    out[a] = drafts[a];
    ++a;
  }
  out[a] = (bonus != nullptr && a == n) ? *bonus : argmax[a];
  return a;
}

std::tuple<at::Tensor, at::Tensor> verify_greedy_cpu(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                                                     const at::Tensor& num_draft_tokens) {
  TORCH_CHECK_VALUE(target_logits.dim() == 3, "target_logits must be [B, K + 1, V]");
  const int64_t B = target_logits.size(0), K1 = target_logits.size(1), K = K1 - 1;
  at::Tensor out = at::full({B, K1}, -1, target_logits.options().dtype(at::kLong));
  at::Tensor num_accepted = at::zeros({B}, target_logits.options().dtype(at::kLong));
  if (B == 0) return {out, num_accepted};
  const at::Tensor argmax = rows_argmax(target_logits);  // torch.argmax semantics, [B * (K + 1)]
  const at::Tensor drafts = draft_tokens.to(at::kLong).contiguous();
  const at::Tensor counts = num_draft_tokens.to(at::kLong).contiguous();
  check_cpu(drafts, "draft_tokens");
  const int64_t* am = argmax.data_ptr<int64_t>();
  const int64_t* dr = drafts.data_ptr<int64_t>();
  const int64_t* cn = counts.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  int64_t* na = num_accepted.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    na[b] = greedy_chain(am + b * K1, dr + b * K, clamp64(cn[b], 0, K), nullptr, o + b * K1);
  }
  return {out, num_accepted};
}

// The flattened form: argmaxes of every flat row, then each request's walk over its span.
std::tuple<at::Tensor, at::Tensor> verify_greedy_flattened_cpu(const at::Tensor& target_logits,
                                                               const at::Tensor& draft_token_ids,
                                                               const at::Tensor& cu_num_draft_tokens,
                                                               const c10::optional<at::Tensor>& bonus_token_ids,
                                                               int64_t max_spec_len) {
  TORCH_CHECK_VALUE(target_logits.dim() == 2, "target_logits must be [T + B, V] or [T, V]");
  TORCH_CHECK_VALUE(draft_token_ids.dim() == 1 && cu_num_draft_tokens.dim() == 1,
                    "draft_token_ids and cu_num_draft_tokens must be 1-D");
  TORCH_CHECK_VALUE(max_spec_len >= 0, "max_spec_len must be >= 0");
  const bool has_bonus = given(bonus_token_ids);
  const int64_t T = draft_token_ids.size(0), B = cu_num_draft_tokens.size(0), K = max_spec_len, K1 = K + 1;
  TORCH_CHECK_VALUE(target_logits.size(0) == (has_bonus ? T : T + B),
                    "target_logits must have T + B rows, or T with bonus_token_ids");
  TORCH_CHECK_VALUE(!has_bonus || bonus_token_ids->numel() == B, "bonus_token_ids must be [B]");
  at::Tensor out = at::full({B, K1}, -1, target_logits.options().dtype(at::kLong));
  at::Tensor num_accepted = at::zeros({B}, target_logits.options().dtype(at::kLong));
  if (B == 0) return {out, num_accepted};
  const at::Tensor argmax = rows_argmax(target_logits);  // [rows]
  const at::Tensor drafts = draft_token_ids.to(at::kLong).contiguous();
  const at::Tensor cu = cu_num_draft_tokens.to(at::kLong).contiguous();
  const at::Tensor bonus = has_bonus ? bonus_token_ids->to(at::kLong).contiguous() : at::Tensor();
  const int64_t* am = argmax.data_ptr<int64_t>();
  const int64_t* dr = drafts.data_ptr<int64_t>();
  const int64_t* c = cu.data_ptr<int64_t>();
  const int64_t* bn = has_bonus ? bonus.data_ptr<int64_t>() : nullptr;
  int64_t* o = out.data_ptr<int64_t>();
  int64_t* na = num_accepted.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const Span s = flat_span(c, b, T, K);
    const int64_t row0 = s.start + (has_bonus ? 0 : b);
    na[b] = greedy_chain(am + row0, dr + s.start, s.n, has_bonus ? bn + b : nullptr, o + b * K1);
  }
  return {out, num_accepted};
}

// ------------------------------------------------------------------------- verify_tree_greedy
// The reference's single pass in node order: node j is accepted when its parent is the current
// node, j < num_nodes and its token is the target's argmax at the current node (with parents in
// topological order, the lowest-index matching child).  Parents are only compared, never used
// as addresses, so any parent value is safe, and the accepted path is always increasing.
std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_greedy_cpu(const at::Tensor& target_logits,
                                                                      const at::Tensor& tree_tokens,
                                                                      const at::Tensor& tree_parents,
                                                                      const at::Tensor& num_nodes) {
  TORCH_CHECK_VALUE(target_logits.dim() == 3, "target_logits must be [B, N, V]");
  const int64_t B = target_logits.size(0), N = target_logits.size(1);
  const auto opts = target_logits.options().dtype(at::kLong);
  at::Tensor out = at::full({B, N}, -1, opts);
  at::Tensor accepted = at::full({B, N}, -1, opts);
  at::Tensor num_accepted = at::zeros({B}, opts);
  if (B == 0 || N == 0) return {out, accepted, num_accepted};
  const at::Tensor argmax = rows_argmax(target_logits);  // [B * N]
  const at::Tensor tokens = tree_tokens.to(at::kLong).contiguous();
  const std::pair<at::Tensor, int64_t> shared_parents = per_sequence(tree_parents, at::kLong);
  const at::Tensor& parents = shared_parents.first;
  const int64_t parent_stride = shared_parents.second;
  const at::Tensor counts = num_nodes.to(at::kLong).contiguous();
  const int64_t* am = argmax.data_ptr<int64_t>();
  const int64_t* tk = tokens.data_ptr<int64_t>();
  const int64_t* pa = parents.data_ptr<int64_t>();
  const int64_t* cn = counts.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  int64_t* acc = accepted.data_ptr<int64_t>();
  int64_t* na = num_accepted.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = clamp64(cn[b], 0, N);
    const int64_t* t = tk + b * N;
    const int64_t* p = pa + b * parent_stride;
    int64_t current = 0, depth = 0;
    acc[b * N] = 0;
    for (int64_t j = 1; j < n; ++j) {
      if (p[j] == current && t[j] == am[b * N + current]) {
        o[b * N + depth] = t[j];
        ++depth;
        acc[b * N + depth] = j;
        current = j;
      }
    }
    o[b * N + depth] = am[b * N + current];
    na[b] = depth;
  }
  return {out, accepted, num_accepted};
}

// --------------------------------------------------------------------------- rejection_sample
// One pass per request, parallel over requests; `layout` says where its rows are (padded or
// flattened).  With `bonus_ids` (flattened, [T, V] targets) a fully accepted request emits
// bonus_ids[b] and samples nothing; its would-be bonus row is never addressed.
template <typename T>
void rejection_sample_rows(const Rows<T>& target, const Rows<T>& draft, bool has_draft, const int64_t* tokens,
                           const ChainLayout& layout, const int64_t* bonus_ids, const Uniforms& uniforms, int64_t B,
                           int64_t V, int64_t* out, int64_t* num_accepted) {
  const int64_t K1 = layout.K + 1;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> w(static_cast<size_t>(V));
    std::vector<T> p_scratch, q_scratch;
    for (int64_t b = begin; b < end; ++b) {
      const ChainLayout::Rows rows = layout.at(b);
      const int64_t n = rows.n;
      const int64_t* x = tokens + rows.draft_row;
      // 1. accept x_j while u_j * q_j(x_j) < p_j(x_j) in float32 (p = 0 never accepts)
      int64_t a = 0;
      while (a < n) {
        const int64_t t = x[a];
        if (t < 0 || t >= V) break;
        const float p = f32(target.at(rows.target_row + a, t));
        const float q = has_draft ? f32(draft.at(rows.draft_row + a, t)) : 1.0f;
        if (!(uniforms.coin(b, rows.coin_row + a, a) * q < p)) break;
        ++a;
      }
      const bool rejected = a < n;
      int64_t sampled;
      if (!rejected && bonus_ids != nullptr) {
        sampled = bonus_ids[b];
      } else {
        // 2. the row to sample: the residual max(0, p - q) at the first rejection (p itself
        //    when that has no mass), else the bonus row after the last draft
        const T* p_row = target.contiguous_row(rows.target_row + a, p_scratch);
        bool residual_mass = false;
        if (rejected) {
          if (has_draft) {
            const T* q_row = draft.contiguous_row(rows.draft_row + a, q_scratch);
            for (int64_t i = 0; i < V; ++i) {
              const float r = f32(p_row[i]) - f32(q_row[i]);
              w[i] = mass(static_cast<double>(r));
              residual_mass |= r > 0;
            }
          } else {
            const int64_t at = x[a];  // rejected: a < n, inside the request's drafts
            for (int64_t i = 0; i < V; ++i) {
              const float r = f32(p_row[i]) - (i == at ? 1.0f : 0.0f);
              w[i] = mass(static_cast<double>(r));
              residual_mass |= r > 0;
            }
          }
        }
        if (!residual_mass) {
          for (int64_t i = 0; i < V; ++i) w[i] = mass(static_cast<double>(f32(p_row[i])));
        }
        sampled = sample_weights(w, static_cast<double>(uniforms.final(b)));
      }
      for (int64_t j = 0; j < a; ++j) out[b * K1 + j] = x[j];
      out[b * K1 + a] = sampled;
      for (int64_t j = a + 1; j < K1; ++j) out[b * K1 + j] = -1;
      num_accepted[b] = a;
    }
  });
}

// The probability operands: on the CPU, draft of the target's dtype (the Python op makes them so).
void check_probs_cpu(const at::Tensor& target_probs, const c10::optional<at::Tensor>& draft_probs) {
  check_cpu(target_probs, "target_probs");
  if (given(draft_probs)) {
    check_cpu(*draft_probs, "draft_probs");
    TORCH_CHECK_VALUE(draft_probs->scalar_type() == target_probs.scalar_type(),
                      "draft_probs must have target_probs' dtype");
  }
}

std::tuple<at::Tensor, at::Tensor> rejection_sample_cpu(
    const at::Tensor& target_probs, const c10::optional<at::Tensor>& draft_probs, const at::Tensor& draft_tokens,
    const at::Tensor& num_draft_tokens, const c10::optional<at::Tensor>& uniform_samples,
    const c10::optional<at::Tensor>& sample_uniforms, const c10::optional<at::Tensor>& seeds,
    const c10::optional<at::Tensor>& offsets) {
  TORCH_CHECK_VALUE(target_probs.dim() == 3, "target_probs must be [B, K + 1, V]");
  const int64_t B = target_probs.size(0), K = target_probs.size(1) - 1, V = target_probs.size(2);
  const auto opts = target_probs.options().dtype(at::kLong);
  at::Tensor out = at::empty({B, K + 1}, opts), num_accepted = at::empty({B}, opts);
  if (B == 0) return {out, num_accepted};
  const bool has_draft = given(draft_probs);
  check_probs_cpu(target_probs, draft_probs);
  const at::Tensor tokens = draft_tokens.to(at::kLong).contiguous();
  const at::Tensor counts = num_draft_tokens.to(at::kLong).contiguous();
  const Uniforms uniforms(uniform_samples, sample_uniforms, seeds, offsets, B, B * K);
  const ChainLayout layout{counts.data_ptr<int64_t>(), K, B * K, /*flat=*/false, /*bonus_rows=*/true};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, target_probs.scalar_type(), "rejection_sample_cpu", [&] {
    rejection_sample_rows<scalar_t>(Rows<scalar_t>(target_probs),
                                    has_draft ? Rows<scalar_t>(*draft_probs) : Rows<scalar_t>(), has_draft,
                                    tokens.data_ptr<int64_t>(), layout, nullptr, uniforms, B, V,
                                    out.data_ptr<int64_t>(), num_accepted.data_ptr<int64_t>());
  });
  return {out, num_accepted};
}

// The flattened form (vLLM v1): target [T + B, V] (bonus rows inline) or [T, V] with
// bonus_token_ids [B]; draft_probs [T, V] or none; tokens [T]; coins [T] or [B, K]; output
// [B, K + 1].
std::tuple<at::Tensor, at::Tensor> rejection_sample_flattened_cpu(
    const at::Tensor& target_probs, const c10::optional<at::Tensor>& draft_probs, const at::Tensor& draft_token_ids,
    const at::Tensor& cu_num_draft_tokens, const c10::optional<at::Tensor>& bonus_token_ids,
    const c10::optional<at::Tensor>& uniform_samples, const c10::optional<at::Tensor>& sample_uniforms,
    int64_t max_spec_len, const c10::optional<at::Tensor>& seeds, const c10::optional<at::Tensor>& offsets) {
  TORCH_CHECK_VALUE(target_probs.dim() == 2, "target_probs must be [T + B, V] or [T, V]");
  TORCH_CHECK_VALUE(draft_token_ids.dim() == 1 && cu_num_draft_tokens.dim() == 1,
                    "draft_token_ids and cu_num_draft_tokens must be 1-D");
  TORCH_CHECK_VALUE(max_spec_len >= 0, "max_spec_len must be >= 0");
  const bool has_draft = given(draft_probs);
  const bool has_bonus = given(bonus_token_ids);
  const int64_t T = draft_token_ids.size(0), B = cu_num_draft_tokens.size(0), V = target_probs.size(1),
                K = max_spec_len;
  TORCH_CHECK_VALUE(target_probs.size(0) == (has_bonus ? T : T + B),
                    "target_probs must have T + B rows, or T with bonus_token_ids");
  TORCH_CHECK_VALUE(!has_draft || (draft_probs->dim() == 2 && draft_probs->size(0) == T && draft_probs->size(1) == V),
                    "draft_probs must be [T, V]");
  TORCH_CHECK_VALUE(!has_bonus || bonus_token_ids->numel() == B, "bonus_token_ids must be [B]");
  const auto opts = target_probs.options().dtype(at::kLong);
  at::Tensor out = at::empty({B, K + 1}, opts), num_accepted = at::empty({B}, opts);
  if (B == 0) return {out, num_accepted};
  check_probs_cpu(target_probs, draft_probs);
  const at::Tensor tokens = draft_token_ids.to(at::kLong).contiguous();
  const at::Tensor cu = cu_num_draft_tokens.to(at::kLong).contiguous();
  const at::Tensor bonus = has_bonus ? bonus_token_ids->to(at::kLong).contiguous() : at::Tensor();
  // coins [T], or [B, K] (request b's coin j at b * K + j)
  const bool padded_coins = given(uniform_samples) && uniform_samples->dim() == 2;
  const Uniforms uniforms(uniform_samples, sample_uniforms, seeds, offsets, B, padded_coins ? B * K : T);
  const ChainLayout layout{cu.data_ptr<int64_t>(), K, T, /*flat=*/true, /*bonus_rows=*/!has_bonus, padded_coins};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, target_probs.scalar_type(), "rejection_sample_flattened_cpu", [&] {
        rejection_sample_rows<scalar_t>(
            Rows<scalar_t>(target_probs), has_draft ? Rows<scalar_t>(*draft_probs) : Rows<scalar_t>(), has_draft,
            tokens.data_ptr<int64_t>(), layout, has_bonus ? bonus.data_ptr<int64_t>() : nullptr, uniforms, B, V,
            out.data_ptr<int64_t>(), num_accepted.data_ptr<int64_t>());
      });
  return {out, num_accepted};
}

// ---------------------------------------------------------------------- tree_rejection_sample
template <typename T>
void tree_rejection_rows(const Rows<T>& target, const Rows<T>& draft, bool has_draft, const int64_t* tokens,
                         const int64_t* parents, int64_t parent_stride, const int64_t* counts, const Uniforms& uniforms,
                         int64_t B, int64_t N, int64_t V, int64_t* out, int64_t* accepted, int64_t* num_accepted) {
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> residual(static_cast<size_t>(V)), q(static_cast<size_t>(V)), fresh(static_cast<size_t>(V));
    std::vector<T> scratch;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = clamp64(counts[b], 0, N);
      const int64_t* tk = tokens + b * N;
      const int64_t* pa = parents + b * parent_stride;
      auto target_row = [&](int64_t node, std::vector<double>& dst) {
        const T* p_row = target.contiguous_row(b * N + node, scratch);
        double total = 0.0;
        for (int64_t i = 0; i < V; ++i) {
          dst[i] = mass(static_cast<double>(f32(p_row[i])));
          total += dst[i];
        }
        return total;
      };
      int64_t current = 0, depth = 0;
      double total = target_row(0, residual);
      for (int64_t j = 0; j < N; ++j) accepted[b * N + j] = -1;
      accepted[b * N] = 0;
      // One pass in node order visits every node's children in index order (the reference's).
      for (int64_t j = 1; j < N; ++j) {
        if (!(pa[j] == current && j < n)) continue;
        const int64_t x = tk[j];
        const bool in_vocab = x >= 0 && x < V;
        const int64_t xs = clamp64(x, 0, V - 1);
        const double r_x = residual[xs];
        const double u = static_cast<double>(uniforms.coin(b, b * (N - 1) + (j - 1), j - 1));
        bool accept;
        if (has_draft) {
          const T* q_row = draft.contiguous_row(b * N + current, scratch);
          for (int64_t i = 0; i < V; ++i) q[i] = mass(static_cast<double>(f32(q_row[i])));
          // accept with probability min(1, p'(x) / q(x)), p' = residual / total
          accept = in_vocab && (u * q[xs] * total < r_x);
          if (!accept) {  // p' <- norm(max(0, p' - q)), kept as it was when that has no mass
            // scaled by the reciprocal, as the reference and the GPU kernels do (one division)
            const double inv_total = 1.0 / (total > 0 ? total : 1.0);
            double new_total = 0.0;
            for (int64_t i = 0; i < V; ++i) {
              fresh[i] = mass(residual[i] * inv_total - q[i]);
              new_total += fresh[i];
            }
            if (new_total > 0) {
              residual.swap(fresh);
              total = new_total;
            }
          }
        } else {
          // a deterministic child is accepted with probability p'(x); on rejection it leaves p'
          accept = in_vocab && (u * total < r_x);
          if (!accept && in_vocab) {
            total -= r_x;
            residual[xs] = 0.0;
          }
        }
        if (accept) {
          out[b * N + depth] = x;
          ++depth;
          accepted[b * N + depth] = j;
          current = j;
          total = target_row(j, residual);
        }
      }
      bool any_mass = false;
      for (int64_t i = 0; i < V && !any_mass; ++i) any_mass = residual[i] > 0;
      if (!any_mass) target_row(current, residual);
      const int64_t sampled = sample_weights(residual, static_cast<double>(uniforms.final(b)));
      out[b * N + depth] = sampled;
      for (int64_t j = depth + 1; j < N; ++j) out[b * N + j] = -1;
      num_accepted[b] = depth;
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_rejection_sample_cpu(
    const at::Tensor& target_probs, const at::Tensor& tree_tokens, const at::Tensor& tree_parents,
    const c10::optional<at::Tensor>& draft_probs, const at::Tensor& num_nodes,
    const c10::optional<at::Tensor>& uniform_samples, const c10::optional<at::Tensor>& sample_uniforms,
    const c10::optional<at::Tensor>& seeds, const c10::optional<at::Tensor>& offsets) {
  TORCH_CHECK_VALUE(target_probs.dim() == 3, "target_probs must be [B, N, V]");
  const int64_t B = target_probs.size(0), N = target_probs.size(1), V = target_probs.size(2);
  const auto opts = target_probs.options().dtype(at::kLong);
  at::Tensor out = at::empty({B, N}, opts), accepted = at::empty({B, N}, opts), num_accepted = at::empty({B}, opts);
  if (B == 0 || N == 0) return {out, accepted, num_accepted};
  const bool has_draft = given(draft_probs);
  check_probs_cpu(target_probs, draft_probs);
  const at::Tensor tokens = tree_tokens.to(at::kLong).contiguous();
  const std::pair<at::Tensor, int64_t> shared_parents = per_sequence(tree_parents, at::kLong);
  const at::Tensor& parents = shared_parents.first;
  const int64_t parent_stride = shared_parents.second;
  const at::Tensor counts = num_nodes.to(at::kLong).contiguous();
  const Uniforms uniforms(uniform_samples, sample_uniforms, seeds, offsets, B, B * (N - 1));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, target_probs.scalar_type(), "tree_rejection_sample_cpu", [&] {
        tree_rejection_rows<scalar_t>(
            Rows<scalar_t>(target_probs), has_draft ? Rows<scalar_t>(*draft_probs) : Rows<scalar_t>(), has_draft,
            tokens.data_ptr<int64_t>(), parents.data_ptr<int64_t>(), parent_stride, counts.data_ptr<int64_t>(),
            uniforms, B, N, V, out.data_ptr<int64_t>(), accepted.data_ptr<int64_t>(), num_accepted.data_ptr<int64_t>());
      });
  return {out, accepted, num_accepted};
}

// ----------------------------------------------------------------------------- sampling_probs
// Temperature, top-k by selection (nth_element: the k-th largest, ties kept), softmax, top-p
// from a heap popped in descending order until the reference's mass-before test fails (the
// running float64 sum, as torch's cumsum over the sorted row: no full sort), renormalisation.
// The softmax denominator and the renormalisation's kept mass are float64 sums (a float32
// running sum was off by 5.8e-5 at V = 49152), then each probability is one float32 multiply by
// the float64 reciprocal rounded to float32, or one divide by the kept mass rounded to float32,
// exactly as the reference computes them: rows sum to 1 within a few float32 ulps at any V, and
// only exp's last bit can differ from the reference's.
template <typename T>
void sampling_rows(const Rows<T>& logits, float* out, const float* temperature, const int64_t* top_k,
                   const float* top_p, int64_t R, int64_t V, int64_t rows_per_seq) {
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(static_cast<size_t>(V)), scratch;
    std::vector<T> gathered;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t seq = r / rows_per_seq;
      const T* row = logits.contiguous_row(r, gathered);
      float* o = out + r * V;
      const float t = temperature[seq];
      const bool greedy = t == 0.0f;
      const float tdiv = greedy ? 1.0f : t;
      bool has_nan = false, has_inf = false;
      for (int64_t i = 0; i < V; ++i) {
        x[i] = f32(row[i]) / tdiv;
        has_nan |= std::isnan(x[i]);
        has_inf |= x[i] == std::numeric_limits<float>::infinity();
      }
      if (greedy || (has_inf && !has_nan)) {
        // one-hot at the largest logit (first max, NaN first): the limit of T -> 0, also where
        // a tiny temperature made several logits +inf
        int64_t best = 0;
        for (int64_t i = 1; i < V; ++i) {
          if (std::isnan(x[best])) break;
          if (std::isnan(x[i]) || f32(row[i]) > f32(row[best])) best = i;
        }
        std::fill(o, o + V, 0.0f);
        o[best] = 1.0f;
        continue;
      }
      if (has_nan) {
        std::fill(o, o + V, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      // top-k: keep the logits >= the k-th largest
      const int64_t k = top_k ? top_k[seq] : 0;
      if (k > 0 && k < V) {
        scratch.assign(x.begin(), x.end());
        std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
        const float kth = scratch[k - 1];
        for (int64_t i = 0; i < V; ++i)
          if (x[i] < kth) x[i] = -std::numeric_limits<float>::infinity();
      }
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < V; ++i) m = std::max(m, x[i]);
      if (m == -std::numeric_limits<float>::infinity()) {  // no finite logit: the reference's NaN
        std::fill(o, o + V, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      double s = 0.0;
      for (int64_t i = 0; i < V; ++i) {
        o[i] = std::exp(x[i] - m);
        s += static_cast<double>(o[i]);
      }
      const float inv = static_cast<float>(1.0 / s);
      for (int64_t i = 0; i < V; ++i) o[i] *= inv;
      // top-p: size = #{i : mass_before_i < top_p} in descending order, where mass_before_i is
      // the running float64 sum through i minus p_i (the reference's cumsum - p); keep p >= the
      // size-th largest (ties kept)
      const float p_top = top_p ? top_p[seq] : 1.0f;
      if (p_top < 1.0f) {
        scratch.assign(o, o + V);
        std::make_heap(scratch.begin(), scratch.end());
        const double target_mass = static_cast<double>(p_top);
        double c = 0.0;
        float threshold = scratch.front();
        auto heap_end = scratch.end();
        while (heap_end != scratch.begin()) {
          const float v = scratch.front();
          const double before = (c + static_cast<double>(v)) - static_cast<double>(v);
          if (!(before < target_mass)) break;
          c += static_cast<double>(v);
          threshold = v;
          std::pop_heap(scratch.begin(), heap_end);
          --heap_end;
        }
        for (int64_t i = 0; i < V; ++i)
          if (!(o[i] >= threshold)) o[i] = 0.0f;
      }
      double kept = 0.0;
      for (int64_t i = 0; i < V; ++i) kept += static_cast<double>(o[i]);
      const float kept_f = static_cast<float>(kept);
      for (int64_t i = 0; i < V; ++i) o[i] /= kept_f;
    }
  });
}

at::Tensor sampling_probs_cpu(const at::Tensor& logits, const at::Tensor& temperature,
                              const c10::optional<at::Tensor>& top_k, const c10::optional<at::Tensor>& top_p) {
  TORCH_CHECK_VALUE(logits.dim() == 2 || logits.dim() == 3, "logits must be [B, V] or [B, rows, V]");
  check_cpu(logits, "logits");
  const int64_t B = logits.size(0), V = logits.size(-1);
  const int64_t R = B == 0 ? 0 : logits.numel() / V;
  at::Tensor out = at::empty(logits.sizes(), logits.options().dtype(at::kFloat));
  if (R == 0 || V == 0) return out;
  const at::Tensor t = temperature.to(at::kFloat).contiguous();
  const bool use_k = given(top_k), use_p = given(top_p);
  const at::Tensor k = use_k ? top_k->to(at::kLong).contiguous() : at::Tensor();
  const at::Tensor p = use_p ? top_p->to(at::kFloat).contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "sampling_probs_cpu", [&] {
    sampling_rows<scalar_t>(Rows<scalar_t>(logits), out.data_ptr<float>(), t.data_ptr<float>(),
                            use_k ? k.data_ptr<int64_t>() : nullptr, use_p ? p.data_ptr<float>() : nullptr, R, V,
                            R / B);
  });
  return out;
}

// The counter-based uniforms the kernels above compute, as a tensor: float32 [B, width], entry
// [b, j] from seeds[b] at offsets[b] + j on `stream` (a debug path: the tests compare it with
// specdec_kernels._random.philox_uniforms bit for bit).
at::Tensor philox_uniforms_cpu(const at::Tensor& seeds, const at::Tensor& offsets, int64_t width, int64_t stream) {
  TORCH_CHECK_VALUE(seeds.dim() == 1 && offsets.dim() == 1 && seeds.size(0) == offsets.size(0),
                    "seeds and offsets must be [B]");
  TORCH_CHECK_VALUE(width >= 0 && (stream == 0 || stream == 1), "width must be >= 0 and stream 0 or 1");
  const int64_t B = seeds.size(0);
  at::Tensor out = at::empty({B, width}, seeds.options().dtype(at::kFloat));
  if (B == 0 || width == 0) return out;
  const Uniforms uniforms(c10::nullopt, c10::nullopt, seeds, offsets, B, 0);
  float* o = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < width; ++j) {
      const uint64_t pos = static_cast<uint64_t>(uniforms.offsets[b]) + static_cast<uint64_t>(j);
      o[b * width + j] =
          safe_uniform(philox_uniform(static_cast<uint64_t>(uniforms.seeds[b]), pos, static_cast<uint32_t>(stream)));
    }
  }
  return out;
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec_native, CPU, m) {
  m.impl("philox_uniforms", &specdec::philox_uniforms_cpu);
  m.impl("verify_greedy", &specdec::verify_greedy_cpu);
  m.impl("verify_greedy_flattened", &specdec::verify_greedy_flattened_cpu);
  m.impl("verify_tree_greedy", &specdec::verify_tree_greedy_cpu);
  m.impl("rejection_sample", &specdec::rejection_sample_cpu);
  m.impl("rejection_sample_flattened", &specdec::rejection_sample_flattened_cpu);
  m.impl("tree_rejection_sample", &specdec::tree_rejection_sample_cpu);
  m.impl("sampling_probs", &specdec::sampling_probs_cpu);
}
