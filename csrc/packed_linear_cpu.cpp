// CPU matrix product with a block-quantised weight (torch.ops.specdec_engine.packed_linear):
// y = x @ W^T, where W [O, I] is stored in blocks of 32 consecutive inputs of one output row,
// in one of the two forms of GGUF's (ggml's) quantisation types that SmolLM2's GGUF uses:
//
//   kind 0, "affine4" (ggml Q4_1): W[o, 32 j + i] = q * d[o, j] + m[o, j], q in 0..15 stored as
//           nibbles: byte 16 j + i of row o holds q(i) in its low and q(i + 16) in its high bits;
//   kind 1, "scaled8" (ggml Q8_0): W[o, 32 j + i] = q * d[o, j], q an int8 at [o, 32 j + i];
//   kind 2, "float32": W itself, float32 [O, I] (a weight with no packed form, multiplied in the
//           same fixed order so that its rows are independent too).
//
// d and m are float32 here.  The Python side (specdec_kernels/decoding/packed.py) packs a weight
// only when these formulas give back every float32 element bit for bit (d taken from fp16,
// so q * d is exact and one rounding, the add, remains: the same as an FMA), so this is the
// weight's own matrix product, not an approximation: only the order of the float32 additions
// differs from F.linear's.  The weight moves 0.75 (affine4) or 1.125 (scaled8) bytes per element
// instead of 4, which is what a one-row product on a CPU is bound by.
//
// Per output row o, each dot with a row of x runs in one fixed order: four 8-lane accumulators,
// accumulator p summing inputs 32 j + 8 p .. 32 j + 8 p + 7 over the blocks j, then added as
// (a0 + a1) + (a2 + a3) lane-wise and across lanes pairwise.  The order does not depend on the
// number of rows of x, so a row's output does not depend on the other rows or on their count
// (a verification pass over N tokens gives each token the products a one-token pass gives it,
// and a prefill chunk of any size the products of any other).  Up to two rows of x decode each
// block in registers as they go; more rows decode four weight rows into a float32 buffer and take
// the rows of x two at a time against the four, one accumulator index p at a time (tile_avx2:
// the same values, the same order).
// The AVX2 + FMA path and the portable path compute the same formula; they may differ in the last
// bits, since the portable path leaves contraction to the compiler.  Output rows are split over
// at::parallel_for.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace specdec {
namespace {

constexpr int64_t QBLOCK = 32;

// ---------------------------------------------------------------- portable path
void decode_row_portable(int kind, const uint8_t* codes, const float* d, const float* m, int64_t I, float* w) {
  const int64_t nb = I / QBLOCK;
  for (int64_t j = 0; j < nb; ++j) {
    const float dj = d[j];
    if (kind == 0) {
      const uint8_t* c = codes + j * (QBLOCK / 2);
      const float mj = m[j];
      for (int64_t i = 0; i < QBLOCK / 2; ++i) {
        w[j * QBLOCK + i] = float(c[i] & 0x0F) * dj + mj;
        w[j * QBLOCK + i + QBLOCK / 2] = float(c[i] >> 4) * dj + mj;
      }
    } else {
      const int8_t* c = reinterpret_cast<const int8_t*>(codes) + j * QBLOCK;
      for (int64_t i = 0; i < QBLOCK; ++i) w[j * QBLOCK + i] = float(c[i]) * dj;
    }
  }
}

float dot_portable(const float* w, const float* x, int64_t I) {
  float acc[4][8] = {};
  for (int64_t c = 0; c < I / 8; ++c)
    for (int l = 0; l < 8; ++l) acc[c & 3][l] += w[c * 8 + l] * x[c * 8 + l];
  float lanes[8];
  for (int l = 0; l < 8; ++l) lanes[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
  // the same pairwise order as the AVX2 horizontal sum below
  const float a0 = lanes[0] + lanes[4], a1 = lanes[1] + lanes[5], a2 = lanes[2] + lanes[6], a3 = lanes[3] + lanes[7];
  return (a0 + a2) + (a1 + a3);
}

void rows_portable(int kind, const uint8_t* codes, const float* d, const float* m, const float* x, float* y, int64_t R,
                   int64_t I, int64_t O, int64_t o0, int64_t o1) {
  std::vector<float> w(kind == 2 ? 0 : I);
  const int64_t nb = I / QBLOCK, row_bytes = kind == 0 ? I / 2 : kind == 1 ? I : 4 * I;
  for (int64_t o = o0; o < o1; ++o) {
    const float* wr = reinterpret_cast<const float*>(codes + o * row_bytes);
    if (kind != 2) {
      decode_row_portable(kind, codes + o * row_bytes, d + o * nb, m ? m + o * nb : nullptr, I, w.data());
      wr = w.data();
    }
    for (int64_t r = 0; r < R; ++r) y[r * O + o] = dot_portable(wr, x + r * I, I);
  }
}

#ifdef SPECDEC_X86
// ---------------------------------------------------------------- AVX2 + FMA path
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l, l + 4
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));                                  // (0+4)+(2+6), (1+5)+(3+7)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Block j of a row as four vectors of 8 float32 weights (inputs 32 j + 8 p .. 32 j + 8 p + 7).
__attribute__((target("avx2,fma"))) inline void decode_block_avx2(int kind, const uint8_t* codes, const float* d,
                                                                  const float* m, int64_t j, __m256 w[4]) {
  const __m256 dj = _mm256_set1_ps(d[j]);
  if (kind == 0) {
    const __m256 mj = _mm256_set1_ps(m[j]);
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * (QBLOCK / 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(c, mask), hi = _mm_and_si128(_mm_srli_epi16(c, 4), mask);
    // q * d is exact (11 x 4 bits): the FMA rounds once, as q * d + m does
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dj, mj);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dj, mj);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dj, mj);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dj, mj);
  } else {
    const int8_t* c = reinterpret_cast<const int8_t*>(codes) + j * QBLOCK;
    for (int p = 0; p < 4; ++p) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * p));
      w[p] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), dj);
    }
  }
}

// y[r * O] for NR <= 2 rows of x and one weight row: from the codes (DECODE) or from the row
// decoded into w_buf, in the order of dot_portable.
template <int NR, bool DECODE>
__attribute__((target("avx2,fma"))) inline void dots_avx2(int kind, const uint8_t* codes, const float* d,
                                                          const float* m, const float* w_buf, const float* x, int64_t I,
                                                          float* y, int64_t O) {
  __m256 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int p = 0; p < 4; ++p) acc[r][p] = _mm256_setzero_ps();
  for (int64_t j = 0; j < I / QBLOCK; ++j) {
    __m256 w[4];
    if (DECODE) {
      decode_block_avx2(kind, codes, d, m, j, w);
    } else {
      for (int p = 0; p < 4; ++p) w[p] = _mm256_loadu_ps(w_buf + j * QBLOCK + 8 * p);
    }
    for (int r = 0; r < NR; ++r)
      for (int p = 0; p < 4; ++p)
        acc[r][p] = _mm256_fmadd_ps(w[p], _mm256_loadu_ps(x + r * I + j * QBLOCK + 8 * p), acc[r][p]);
  }
  for (int r = 0; r < NR; ++r)
    y[r * O] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
}

// y for NR <= 2 rows of x and NO <= 4 decoded weight rows (w, rows ws floats apart), each dot in
// the order of dot_portable: accumulator p sums chunk p (inputs 8 p .. 8 p + 7) of the blocks j in
// ascending order, then (a0 + a1) + (a2 + a3) lane-wise and hsum8.  The accumulators are taken
// one p at a time (NR x NO of them in registers), so a tile loads NR + NO vectors per NR x NO
// multiply-adds: the same bits as dots_avx2, at about twice its rate on passes of many rows.
template <int NR, int NO>
__attribute__((target("avx2,fma"))) inline void tile_avx2(const float* w, int64_t ws, const float* x, int64_t I,
                                                          float* y, int64_t O) {
  __m256 a01[NR][NO], a2[NR][NO];
  for (int p = 0; p < 4; ++p) {
    __m256 acc[NR][NO];
    for (int r = 0; r < NR; ++r)
      for (int o = 0; o < NO; ++o) acc[r][o] = _mm256_setzero_ps();
    for (int64_t off = 8 * p; off < I; off += QBLOCK) {
      __m256 xv[NR];
      for (int r = 0; r < NR; ++r) xv[r] = _mm256_loadu_ps(x + r * I + off);
      for (int o = 0; o < NO; ++o) {
        const __m256 wv = _mm256_loadu_ps(w + o * ws + off);
        for (int r = 0; r < NR; ++r) acc[r][o] = _mm256_fmadd_ps(wv, xv[r], acc[r][o]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int o = 0; o < NO; ++o) {
        if (p == 0) a01[r][o] = acc[r][o];
        if (p == 1) a01[r][o] = _mm256_add_ps(a01[r][o], acc[r][o]);
        if (p == 2) a2[r][o] = acc[r][o];
        if (p == 3) y[r * O + o] = hsum8(_mm256_add_ps(a01[r][o], _mm256_add_ps(a2[r][o], acc[r][o])));
      }
  }
}

// Every row of x against NO <= 4 decoded weight rows: two rows of x at a time.
template <int NO>
__attribute__((target("avx2,fma"))) void tiles_avx2(const float* w, int64_t ws, const float* x, int64_t R, int64_t I,
                                                    float* y, int64_t O) {
  int64_t r = 0;
  for (; r + 2 <= R; r += 2) tile_avx2<2, NO>(w, ws, x + r * I, I, y + r * O, O);
  if (r < R) tile_avx2<1, NO>(w, ws, x + r * I, I, y + r * O, O);
}

__attribute__((target("avx2,fma"))) void rows_avx2(int kind, const uint8_t* codes, const float* d, const float* m,
                                                   const float* x, float* y, int64_t R, int64_t I, int64_t O,
                                                   int64_t o0, int64_t o1) {
  const int64_t nb = I / QBLOCK, row_bytes = kind == 0 ? I / 2 : kind == 1 ? I : 4 * I;
  if (R <= 2 && kind != 2) {  // a decode step or a pair: each block decoded in registers as it goes
    for (int64_t o = o0; o < o1; ++o) {
      const uint8_t* c = codes + o * row_bytes;
      const float* mr = m ? m + o * nb : nullptr;
      if (R == 1)
        dots_avx2<1, true>(kind, c, d + o * nb, mr, nullptr, x, I, y + o, O);
      else
        dots_avx2<2, true>(kind, c, d + o * nb, mr, nullptr, x, I, y + o, O);
    }
    return;
  }
  // more rows (or a float32 weight): the rows of x in chunks of about 96 KiB (kept in L2 while
  // every weight row of the task passes over them); per chunk, up to 4 weight rows decoded into
  // buf, then tiles of 2 rows of x by those weight rows
  constexpr int64_t TO = 4;
  const int64_t rc = std::max<int64_t>(2, (96 << 10) / (4 * I));
  std::vector<float> buf(kind == 2 ? 0 : TO * I);
  for (int64_t r0 = 0; r0 < R; r0 += rc) {
    const int64_t nr = std::min(rc, R - r0);
    const float* xr = x + r0 * I;
    float* yr = y + r0 * O;
    for (int64_t o = o0; o < o1; o += TO) {
      const int64_t no = std::min(TO, o1 - o);
      const float* w = reinterpret_cast<const float*>(codes + o * row_bytes);
      if (kind != 2) {
        for (int64_t t = 0; t < no; ++t) {
          const uint8_t* c = codes + (o + t) * row_bytes;
          const float* dr = d + (o + t) * nb;
          const float* mr = m ? m + (o + t) * nb : nullptr;
          for (int64_t j = 0; j < nb; ++j) {
            __m256 wv[4];
            decode_block_avx2(kind, c, dr, mr, j, wv);
            for (int p = 0; p < 4; ++p) _mm256_storeu_ps(buf.data() + t * I + j * QBLOCK + 8 * p, wv[p]);
          }
        }
        w = buf.data();
      }
      switch (no) {
        case 4: tiles_avx2<4>(w, I, xr, nr, I, yr + o, O); break;
        case 3: tiles_avx2<3>(w, I, xr, nr, I, yr + o, O); break;
        case 2: tiles_avx2<2>(w, I, xr, nr, I, yr + o, O); break;
        default: tiles_avx2<1>(w, I, xr, nr, I, yr + o, O); break;
      }
    }
  }
}
#endif

// x [R, I] float32 contiguous; codes uint8 [O, I / 2] (kind 0), int8 viewed as uint8 [O, I]
// (kind 1) or the float32 weight [O, I] (kind 2); scales float32 [O, I / 32] (kinds 0 and 1);
// mins float32 [O, I / 32] (kind 0 only).  Returns [R, O].
at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& mins, int64_t kind, bool portable) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, "packed_linear: kind must be 0 (affine4), 1 (scaled8) or 2 (float32), got ",
                    kind);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat, "packed_linear: x must be float32 [R, I]");
  TORCH_CHECK_VALUE(codes.dim() == 2 && codes.scalar_type() == (kind == 2 ? at::kFloat : at::kByte),
                    "packed_linear: codes must be ", kind == 2 ? "float32" : "uint8", " [O, *]");
  const int64_t R = x.size(0), I = x.size(1), O = codes.size(0);
  TORCH_CHECK_VALUE(I % QBLOCK == 0 && I > 0, "packed_linear: the input size must be a positive multiple of 32, got ",
                    I);
  TORCH_CHECK_VALUE(codes.size(1) == (kind == 0 ? I / 2 : I), "packed_linear: codes must be [O, ",
                    kind == 0 ? I / 2 : I, "] for inputs of size ", I);
  TORCH_CHECK_VALUE(kind == 2 || (scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == O &&
                                  scales.size(1) == I / QBLOCK),
                    "packed_linear: scales must be float32 [O, I / 32]");
  TORCH_CHECK_VALUE(kind != 0 || (given(mins) && mins->scalar_type() == at::kFloat && mins->sizes() == scales.sizes()),
                    "packed_linear: affine4 needs mins, float32 [O, I / 32]");
  TORCH_CHECK_VALUE(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(),
                    "packed_linear: CPU tensors only");
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scales.contiguous();
  const at::Tensor mc = kind == 0 ? mins->contiguous() : at::Tensor();
  at::Tensor y = at::empty({R, O}, x.options());
  if (R == 0 || O == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* cp = static_cast<const uint8_t*>(cc.data_ptr());
  const float* dp = kind == 2 ? nullptr : sc.data_ptr<float>();
  const float* mp = kind == 0 ? mc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int k = int(kind);
  // about 64 KiB of weight rows per task, at least 16 rows
  const int64_t grain = std::max<int64_t>(16, (64 << 10) / std::max<int64_t>(1, cc.size(1) * cc.element_size()));
  at::parallel_for(0, O, grain, [&](int64_t o0, int64_t o1) {
#ifdef SPECDEC_X86
    if (!portable && cpu_has_avx2_fma()) return rows_avx2(k, cp, dp, mp, xp, yp, R, I, O, o0, o1);
#endif
    rows_portable(k, cp, dp, mp, xp, yp, R, I, O, o0, o1);
  });
  return y;
}

// ---------------------------------------------------------------- packing
// fp16 rounding of a float32 (round to nearest even), as float32: ggml stores d and m in fp16
inline float fp16_round(float x) { return static_cast<float>(c10::Half(x)); }

// Block b of 32 floats as affine4 codes (q * d + m, q in 0..15, d from fp16, m the block's minimum),
// if those give back every element exactly; q * d is exact (11 x 4 bits), so one rounding remains.
bool pack_affine4_block(const float* w, uint8_t* codes, float* d_out, float* m_out) {
  float lo = w[0], hi = w[0];
  for (int i = 1; i < QBLOCK; ++i) {
    lo = std::min(lo, w[i]);
    hi = std::max(hi, w[i]);
  }
  const float d = fp16_round((hi - lo) / 15.0f);
  uint8_t q[QBLOCK];
  for (int i = 0; i < QBLOCK; ++i) {
    const float c = d > 0 ? std::nearbyint((w[i] - lo) / d) : 0.0f;
    q[i] = static_cast<uint8_t>(std::min(15.0f, std::max(0.0f, c)));
    if (float(q[i]) * d + lo != w[i]) return false;
  }
  for (int i = 0; i < QBLOCK / 2; ++i) codes[i] = uint8_t(q[i] | (q[i + QBLOCK / 2] << 4));
  *d_out = d;
  *m_out = lo;
  return true;
}

// Block b as scaled8 codes (q * d, q an int8, d from fp16), if exact (q * d: 11 x 8 bits, exact).
bool pack_scaled8_block(const float* w, int8_t* codes, float* d_out) {
  float amax = 0.0f;
  for (int i = 0; i < QBLOCK; ++i) amax = std::max(amax, std::fabs(w[i]));
  const float d = fp16_round(amax / 127.0f);
  for (int i = 0; i < QBLOCK; ++i) {
    const float c = d > 0 ? std::nearbyint(w[i] / d) : 0.0f;
    codes[i] = static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, c)));
    if (float(codes[i]) * d != w[i]) return false;
  }
  *d_out = d;
  return true;
}

// (kind, codes, scales, mins): the exact packed form of a float32 weight [O, I] (I % 32 == 0), kind 0
// affine4 when every block has one, else 1 scaled8 when every block has one, else -1 (empty
// tensors).  Non-finite elements never pack (every comparison with them fails).
std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor> packed_weight_cpu(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
                    "packed_weight: weight must be a float32 CPU tensor [O, I]");
  const int64_t O = weight.size(0), I = weight.size(1);
  TORCH_CHECK_VALUE(I % QBLOCK == 0 && I > 0, "packed_weight: the input size must be a positive multiple of 32, got ",
                    I);
  const at::Tensor w = weight.contiguous();
  const float* wp = w.data_ptr<float>();
  const int64_t nb = O * (I / QBLOCK);
  auto f32 = w.options();
  for (int kind = 0; kind < 2; ++kind) {
    at::Tensor codes = at::empty({O, kind == 0 ? I / 2 : I}, f32.dtype(at::kByte));
    at::Tensor scales = at::empty({O, I / QBLOCK}, f32), mins = at::empty({kind == 0 ? O : 0, I / QBLOCK}, f32);
    uint8_t* cp = codes.data_ptr<uint8_t>();
    float* dp = scales.data_ptr<float>();
    float* mp = mins.data_ptr<float>();
    std::atomic<bool> ok{true};
    at::parallel_for(0, nb, 4096, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1 && ok.load(std::memory_order_relaxed); ++b) {
        const bool fits = kind == 0
                              ? pack_affine4_block(wp + b * QBLOCK, cp + b * (QBLOCK / 2), dp + b, mp + b)
                              : pack_scaled8_block(wp + b * QBLOCK, reinterpret_cast<int8_t*>(cp) + b * QBLOCK, dp + b);
        if (!fits) ok.store(false, std::memory_order_relaxed);
      }
    });
    if (ok.load()) return {kind, codes, scales, mins};
  }
  return {-1, at::empty({0}, f32.dtype(at::kByte)), at::empty({0}, f32), at::empty({0}, f32)};
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec_engine, CPU, m) {
  m.impl("packed_linear", &specdec::packed_linear_cpu);
  m.impl("packed_weight", &specdec::packed_weight_cpu);
}
