// CPU matrix product with 8-bit activations over block-quantised weights
// (torch.ops.specdec_engine.packed_linear_int8): the arithmetic of ggml's Q4_1 x Q8_1 and
// Q8_0 x Q8_0 dot products, the one llama.cpp uses, laid out so that a pass of several tokens
// reads and unpacks each weight block once.
//
// Activations.  Each row of x [R, I] is cut into blocks of 32 inputs; block j of row r becomes
// int8 codes qx = round_half_even(x * (1 / dx)) with dx = max|x| / 127 (qx in -127..127), and the
// exact float32 sum sx of its 32 inputs (in index order).  A block holding inf or nan gets
// dx = nan, so its outputs are nan, as a float product's would be.  The portable path quantises
// with a scalar loop, every other path with an AVX2 one that gives the same bits (it was a serial
// 4 ns per input: 0.4 ms of a one-token pass and 3.5 ms of a nine-token one, which no thread
// shared); blocks are split over threads past 256 of them.
//
// Weights (decoding/packed.py: interleave) come in groups of 8 output rows (the last group padded
// with zero rows).  Per group and input block j:
//   kind 0 "affine4" (Q4_1, w = q * d + m, q in 0..15): 128 bytes, four chunks c of 32 bytes;
//     byte 4 o + k of chunk c holds q(o, 32 j + 4 c + k) in its low nibble and
//     q(o, 32 j + 16 + 4 c + k) in its high nibble;
//   kind 1 "scaled8" (Q8_0, w = q * d, q int8): 256 bytes, eight chunks t of 32 bytes, byte
//     4 o + k of chunk t holding q(o, 32 j + 4 t + k);
//   d and m: float16 [groups, blocks, 8] (ggml's fp16 scales and mins, converted to float32
//     exactly where they are used).
// So one 32-byte chunk pairs 8 output rows with 4 consecutive inputs, and a dot of 4 unsigned by
// 4 signed bytes per 32-bit lane (AVX-512 VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd)
// against the 4 activation codes broadcast gives 8 outputs at once; eight chunks finish the
// block's integer sum isum(o) = sum_i q(o, i) qx(i), which is exact in int32 on every path.
//
// Per output o and row r, in one fixed order (j ascending), with fused multiply-adds:
//   acc  = fma(float(isum_j(o)), d_j(o) * dx_j, acc)       (float32; d_j(o) the fp16 scale as float32)
//   accm = fma(m_j(o), sx_j, accm)                          (affine4 only; the weight's minimum
//                                                            times the exact input sum)
//   y = acc + accm
// Nothing in it depends on the other rows, their number, the thread split or the instruction
// set: the portable path, the AVX2 path and the AVX-512 VNNI path give the same bits (tested),
// and a row's output is the same in a pass of 1 or of 64 rows.
//
// Paths: isa 1 portable C++, 2 AVX2, 3 AVX-512 VNNI (256-bit vectors: AVX512VL + VNNI; two groups
// in 512-bit vectors ran faster in cache but slower streaming from memory on the development
// machine, so they are not used), 4 AMX (Intel's tile unit: the integer sums of up to 16 rows by
// a block of up to three groups in one tile dot product each, the float32 scaling as on the
// other paths), 0 the best vector path this CPU runs (the probes of common.h, asked at run
// time; AMX is never implied: the engine times it against VNNI per pass shape, since one row
// gains nothing from a tile unit).  Rows are taken four (VNNI) or two (AVX2) at a time against
// the group's unpacked chunks held in registers; groups are split over at::parallel_for.  The
// vector paths prefetch each group's blocks a few ahead (prefetch_block).
#include "common.h"
#include "cpu_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace specdec {
namespace {

constexpr int64_t QBLOCK = 32;
constexpr int64_t GROUP = 8;  // output rows per interleaved group
enum Isa : int64_t { ISA_BEST = 0, ISA_PORTABLE = 1, ISA_AVX2 = 2, ISA_AVX512_VNNI = 3, ISA_AMX = 4 };
constexpr int64_t ISA_LAST = ISA_AMX;

bool isa_supported(int64_t isa) {
#ifdef SPECDEC_X86
  // every SIMD path converts the fp16 scales with F16C's vcvtph2ps
  static const bool f16c = cpu_has_avx2_fma() && __builtin_cpu_supports("f16c");
  if (isa == ISA_AVX2) return f16c;
  if (isa == ISA_AVX512_VNNI) return f16c && cpu_has_avx512_vnni();
#ifdef SPECDEC_AMX
  if (isa == ISA_AMX) return f16c && cpu_has_amx_int8();
#endif
#endif
  return isa == ISA_PORTABLE;
}

// A block's scale d from the largest magnitude of its 32 inputs (nan where one of them is not
// finite), and the inverse its inputs are multiplied by (0 where d is 0 or nan): the scalar steps
// both quantisation paths share.
inline float block_scale(float amax, bool finite) {
  return finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
}

inline float block_inverse(float d) { return std::isfinite(d) && d > 0.0f ? 1.0f / d : 0.0f; }

// The portable quantisation of blocks b0 .. b1 - 1 (of 32 inputs each, x's rows back to back).
void quantize_blocks_portable(const float* x, int64_t b0, int64_t b1, QuantX& out) {
  for (int64_t b = b0; b < b1; ++b) {
    const float* v = x + b * QBLOCK;
    float amax = 0.0f, sum = 0.0f;
    bool finite = true;
    for (int64_t i = 0; i < QBLOCK; ++i) {
      finite = finite && std::isfinite(v[i]);
      amax = std::max(amax, std::fabs(v[i]));
      sum += v[i];
    }
    const float d = block_scale(amax, finite);
    const float id = block_inverse(d);
    int32_t qs = 0;
    for (int64_t i = 0; i < QBLOCK; ++i) {
      const float c = std::nearbyint(v[i] * id);  // round half to even (the default rounding mode)
      const int8_t q = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, c)));
      out.q[b * QBLOCK + i] = q;
      qs += q;
    }
    out.d[b] = d;
    out.s[b] = sum;
    out.qsum[b] = qs;
  }
}

#ifdef SPECDEC_X86
// The same quantisation with AVX2, bit for bit: amax is a maximum (exact in any order), v * id
// one float32 product per input, rounded half to even by vroundps (nearbyint's rounding in the
// default mode), clamped as std::min(127, std::max(-127, c)) is (a NaN c, from an infinite input
// times id = 0, gives -127 on both), the codes' sum exact in int32; the block sums stay scalar
// float32 adds in index order, four blocks' chains interleaved.
__attribute__((target("avx2,fma,f16c"))) void quantize_blocks_avx2(const float* x, int64_t b0, int64_t b1,
                                                                   QuantX& out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = b0; g < b1; g += 4) {
    // the sums of the next four blocks (fewer at the end), their chains interleaved
    const int64_t n = std::min<int64_t>(4, b1 - g);
    const float* vg = x + g * QBLOCK;
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (n == 4) {
      for (int64_t i = 0; i < QBLOCK; ++i) {
        sums[0] += vg[i];
        sums[1] += vg[QBLOCK + i];
        sums[2] += vg[2 * QBLOCK + i];
        sums[3] += vg[3 * QBLOCK + i];
      }
    } else {
      for (int64_t k = 0; k < n; ++k)
        for (int64_t i = 0; i < QBLOCK; ++i) sums[k] += vg[k * QBLOCK + i];
    }
    for (int64_t k = 0; k < n; ++k) {
      const int64_t b = g + k;
      const float* v = x + b * QBLOCK;
      __m256 xv[4], vmax = _mm256_setzero_ps();
      int finite = 0xFF;
      for (int c = 0; c < 4; ++c) {
        xv[c] = _mm256_loadu_ps(v + 8 * c);
        const __m256 a = _mm256_and_ps(xv[c], abs_mask);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));  // false for inf and nan
        vmax = _mm256_max_ps(vmax, a);
      }
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
      const float d = block_scale(_mm_cvtss_f32(m), finite == 0xFF);
      const __m256 id = _mm256_set1_ps(block_inverse(d));
      __m256i q32[4], total = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(xv[c], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);  // max(r, lo): lo where r is nan
        q32[c] = _mm256_cvtps_epi32(r);
        total = _mm256_add_epi32(total, q32[c]);
      }
      const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(q32[0], q32[1]), _mm256_packs_epi32(q32[2], q32[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + b * QBLOCK),
                          _mm256_permutevar8x32_epi32(q16, order));
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
      out.d[b] = d;
      out.s[b] = sums[k];
      out.qsum[b] = _mm_cvtsi128_si32(t);
    }
  }
}
#endif

// The weights' scales d (and affine4's mins m) are fp16, as ggml stores them (Q4_1, Q8_0): half
// the bytes of float32 and the same values (every fp16 value is a float32 one), so a one-row
// product, which streams its weight once, reads 160 instead of 192 bytes per affine4 block of a
// group and 272 instead of 288 per scaled8 block.
inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// ---------------------------------------------------------------- portable path
// One group against one row: y[0..7] (all 8 lanes; the caller keeps the valid ones).
void group_row_portable(int kind, const uint8_t* qw, const uint16_t* dw, const uint16_t* mw, int64_t nb,
                        const int8_t* qx, const float* dx, const float* sx, float* y) {
  float acc[GROUP] = {}, accm[GROUP] = {};
  const int64_t chunk_bytes = kind == 0 ? 128 : 256;
  for (int64_t j = 0; j < nb; ++j) {
    const uint8_t* wb = qw + j * chunk_bytes;
    const int8_t* xb = qx + j * QBLOCK;
    for (int64_t o = 0; o < GROUP; ++o) {
      int32_t isum = 0;
      for (int64_t t = 0; t < 8; ++t)
        for (int64_t k = 0; k < 4; ++k) {
          int32_t w;
          if (kind == 0) {
            const uint8_t byte = wb[(t & 3) * 32 + o * 4 + k];
            w = t < 4 ? (byte & 0x0F) : (byte >> 4);
          } else {
            w = static_cast<int8_t>(wb[t * 32 + o * 4 + k]);
          }
          isum += w * int32_t(xb[t * 4 + k]);
        }
      acc[o] = std::fma(float(isum), half_to_float(dw[j * GROUP + o]) * dx[j], acc[o]);
      if (kind == 0) accm[o] = std::fma(half_to_float(mw[j * GROUP + o]), sx[j], accm[o]);
    }
  }
  for (int64_t o = 0; o < GROUP; ++o) y[o] = acc[o] + accm[o];
}

void groups_portable(int kind, const uint8_t* qw, const uint16_t* dw, const uint16_t* mw, int64_t nb, const QuantX& qx,
                     int64_t R, int64_t I, int64_t O, float* y, int64_t g0, int64_t g1) {
  const int64_t group_bytes = nb * (kind == 0 ? 128 : 256);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t valid = std::min<int64_t>(GROUP, O - g * GROUP);
    for (int64_t r = 0; r < R; ++r) {
      float out[GROUP];
      group_row_portable(kind, qw + g * group_bytes, dw + g * nb * GROUP, mw ? mw + g * nb * GROUP : nullptr, nb,
                         qx.q.data() + r * I, qx.d.data() + r * nb, qx.s.data() + r * nb, out);
      std::memcpy(y + r * O + g * GROUP, out, valid * sizeof(float));
    }
  }
}

#ifdef SPECDEC_X86
__attribute__((target("avx2,fma,f16c"))) inline __m256i load_chunk(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Eight fp16 scales as float32 (exact).
__attribute__((target("avx2,fma,f16c"))) inline __m256 load_scales(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

__attribute__((target("avx2,fma,f16c"))) inline void store_group(float* dst, __m256 v, int64_t valid) {
  if (valid == GROUP) {
    _mm256_storeu_ps(dst, v);
  } else {
    float tmp[GROUP];
    _mm256_storeu_ps(tmp, v);
    std::memcpy(dst, tmp, valid * sizeof(float));
  }
}

// The 8 chunks of block j of a group, as unsigned (affine4) or signed (scaled8) bytes.
__attribute__((target("avx2,fma,f16c"))) inline void unpack_block(int kind, const uint8_t* wb, __m256i w[8]) {
  if (kind == 0) {
    const __m256i lo = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i b = load_chunk(wb + 32 * c);
      w[c] = _mm256_and_si256(b, lo);
      w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(b, 4), lo);
    }
  } else {
    for (int t = 0; t < 8; ++t) w[t] = load_chunk(wb + 32 * t);
  }
}

// The codes, scales (and mins) of block j + PREFETCH_BLOCKS of a group, asked of the memory
// ahead of use: a one-row product streams each weight once, and the hardware prefetcher alone
// left it at about 60% of the read bandwidth (SmolLM2's one-token pass 15.3 -> 13.5 ms on an
// Intel Xeon, 1 thread).  Past the group's end these are the next group's blocks, which follow
// in memory; a prefetch past the tensor's end does not fault.  No arithmetic changes.
constexpr int64_t PREFETCH_BLOCKS = 8;  // 1-2 KiB ahead: best for one row; 24 was better at 5 rows

__attribute__((target("avx2,fma,f16c"))) inline void prefetch_block(int kind, const uint8_t* qw, const uint16_t* dw,
                                                                    const uint16_t* mw, int64_t j) {
  // addresses as integers: past the tensor's end they are never pointers, only hints
  const auto ahead = [](const void* base, int64_t bytes) {
    return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + uintptr_t(bytes));
  };
  const int64_t chunk_bytes = kind == 0 ? 128 : 256, k = j + PREFETCH_BLOCKS;
  for (int64_t c = 0; c < chunk_bytes; c += 64) _mm_prefetch(ahead(qw, k * chunk_bytes + c), _MM_HINT_T0);
  _mm_prefetch(ahead(dw, k * GROUP * 2), _MM_HINT_T0);
  if (kind == 0) _mm_prefetch(ahead(mw, k * GROUP * 2), _MM_HINT_T0);
}

// ---------------------------------------------------------------- AVX2 path
// isum for one row: affine4 sums the 8 vpmaddubsw results in int16 (each at most 2 * 15 * 127,
// eight of them 30480 < 32767: exact); scaled8 multiplies |w| by x with w's sign (at most
// 2 * 128 * 127 = 32512 per pair: exact) and widens each chunk.
__attribute__((target("avx2,fma,f16c"))) inline __m256i isum_avx2(int kind, const __m256i w[8], const __m256i aw[8],
                                                                  const int8_t* xb) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (kind == 0) {
    __m256i s16 = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t)
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[t], _mm256_set1_epi32(load_i32(xb + 4 * t))));
    return _mm256_madd_epi16(s16, ones);
  }
  __m256i s32 = _mm256_setzero_si256();
  for (int t = 0; t < 8; ++t) {
    const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xb + 4 * t)), w[t]);
    s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[t], xs), ones));
  }
  return s32;
}

template <int kind, int RB>
__attribute__((target("avx2,fma,f16c"))) void group_rows_avx2(const uint8_t* qw, const uint16_t* dw, const uint16_t* mw,
                                                              int64_t nb, const int8_t* qx, const float* dx,
                                                              const float* sx, int64_t I, float* y, int64_t O,
                                                              int64_t valid) {
  __m256 acc[RB], accm[RB];
  for (int r = 0; r < RB; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
  const int64_t chunk_bytes = kind == 0 ? 128 : 256;
  for (int64_t j = 0; j < nb; ++j) {
    __m256i w[8], aw[8];
    prefetch_block(kind, qw, dw, mw, j);
    unpack_block(kind, qw + j * chunk_bytes, w);
    if (kind == 1)
      for (int t = 0; t < 8; ++t) aw[t] = _mm256_abs_epi8(w[t]);
    const __m256 d = load_scales(dw + j * GROUP);
    for (int r = 0; r < RB; ++r) {
      const __m256i isum = isum_avx2(kind, w, aw, qx + r * I + j * QBLOCK);
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + j]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
      if (kind == 0) accm[r] = _mm256_fmadd_ps(load_scales(mw + j * GROUP), _mm256_set1_ps(sx[r * nb + j]), accm[r]);
    }
  }
  for (int r = 0; r < RB; ++r) store_group(y + r * O, _mm256_add_ps(acc[r], accm[r]), valid);
}

// ---------------------------------------------------------------- AVX-512 VNNI path (256-bit)
// affine4: vpdpbusd of the unsigned codes by the signed activations.  scaled8: the signed codes
// are made unsigned by adding 128 (xor 0x80), and 128 * (sum of the block's activation codes) is
// subtracted again: exact in int32.
template <int kind, int RB>
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))) void group_rows_vnni(
    const uint8_t* qw, const uint16_t* dw, const uint16_t* mw, int64_t nb, const int8_t* qx, const float* dx,
    const float* sx, const int32_t* qsum, int64_t I, float* y, int64_t O, int64_t valid) {
  __m256 acc[RB], accm[RB];
  for (int r = 0; r < RB; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
  const int64_t chunk_bytes = kind == 0 ? 128 : 256;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t j = 0; j < nb; ++j) {
    __m256i w[8];
    prefetch_block(kind, qw, dw, mw, j);
    unpack_block(kind, qw + j * chunk_bytes, w);
    if (kind == 1)
      for (int t = 0; t < 8; ++t) w[t] = _mm256_xor_si256(w[t], flip);
    const __m256 d = load_scales(dw + j * GROUP);
    for (int r = 0; r < RB; ++r) {
      const int8_t* xb = qx + r * I + j * QBLOCK;
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();  // two chains, one exact sum
      for (int t = 0; t < 8; t += 2) {
        s0 = _mm256_dpbusd_epi32(s0, w[t], _mm256_set1_epi32(load_i32(xb + 4 * t)));
        s1 = _mm256_dpbusd_epi32(s1, w[t + 1], _mm256_set1_epi32(load_i32(xb + 4 * t + 4)));
      }
      __m256i isum = _mm256_add_epi32(s0, s1);
      if (kind == 1) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(128 * qsum[r * nb + j]));
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + j]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
      if (kind == 0) accm[r] = _mm256_fmadd_ps(load_scales(mw + j * GROUP), _mm256_set1_ps(sx[r * nb + j]), accm[r]);
    }
  }
  for (int r = 0; r < RB; ++r) store_group(y + r * O, _mm256_add_ps(acc[r], accm[r]), valid);
}

void groups_simd(int64_t isa, int kind, const uint8_t* qw, const uint16_t* dw, const uint16_t* mw, int64_t nb,
                 const QuantX& qx, int64_t R, int64_t I, int64_t O, float* y, int64_t g0, int64_t g1) {
  const int64_t group_bytes = nb * (kind == 0 ? 128 : 256);
  for (int64_t g = g0; g < g1;) {  // one group of 8 output rows at a time
    const int64_t valid = std::min<int64_t>(GROUP, O - g * GROUP);
    const uint8_t* w = qw + g * group_bytes;
    const uint16_t* d = dw + g * nb * GROUP;
    const uint16_t* m = mw ? mw + g * nb * GROUP : nullptr;
    int64_t r = 0;
    auto rows = [&](auto rb) {
      constexpr int RB = decltype(rb)::value;
      const int64_t off = r * nb;
      const int8_t* xq = qx.q.data() + r * I;
      const float *dxr = qx.d.data() + off, *sxr = qx.s.data() + off;
      const int32_t* qs = qx.qsum.data() + off;
      float* yr = y + r * O + g * GROUP;
      if (isa == ISA_AVX512_VNNI) {
        if (kind == 0)
          group_rows_vnni<0, RB>(w, d, m, nb, xq, dxr, sxr, qs, I, yr, O, valid);
        else
          group_rows_vnni<1, RB>(w, d, m, nb, xq, dxr, sxr, qs, I, yr, O, valid);
      } else if (kind == 0) {
        group_rows_avx2<0, RB>(w, d, m, nb, xq, dxr, sxr, I, yr, O, valid);
      } else {
        group_rows_avx2<1, RB>(w, d, m, nb, xq, dxr, sxr, I, yr, O, valid);
      }
      r += RB;
    };
    if (isa == ISA_AVX512_VNNI)
      while (r + 4 <= R) rows(std::integral_constant<int, 4>());
    while (r + 2 <= R) rows(std::integral_constant<int, 2>());
    if (r < R) rows(std::integral_constant<int, 1>());
    ++g;
  }
}

#endif

#ifdef SPECDEC_AMX
// ---------------------------------------------------------------- AMX path
// A block of a group is already a tile in the layout AMX's dot products read (row t: 8 outputs
// by 4 consecutive inputs, 32 bytes): tile 0 holds the block's activation codes of M <= 16 rows
// (M x 32 bytes, the row stride I), tiles 1..3 the block of up to three groups (8 x 32 bytes;
// affine4's nibbles unpacked to bytes first), tiles 4..6 their int32 sums (M x 8): TDPBSSD
// (signed codes by signed activations, scaled8) or TDPBSUD (signed activations by unsigned
// codes, affine4) gives isum exactly, and the float32 part is the VNNI path's, same order.
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-int8"))) void load_tiles(int64_t M) {
  TileConfig cfg;
  cfg.rows[0] = uint8_t(M);
  cfg.colsb[0] = QBLOCK;
  for (int t = 1; t <= 3; ++t) cfg.rows[t] = 8, cfg.colsb[t] = 32;
  for (int t = 4; t <= 6; ++t) cfg.rows[t] = uint8_t(M), cfg.colsb[t] = GROUP * 4;
  _tile_loadconfig(&cfg);
}

// The float32 part of one block from its tile sums (the VNNI path's steps, j ascending): for
// group t and row m, acc = fma(float(isum), d_j * dx_j, acc), and affine4's accm = fma(m_j, sx_j, accm).
// d and mn point at group 0's scales of the block (group t's are nb * 8 further); dx and sx at row
// 0's value of the block (row m's are m * nb further).
template <int kind, int NG>
__attribute__((target("avx2,fma,f16c"))) inline void amx_scale_block(const int32_t (*sums)[16][GROUP],
                                                                     const uint16_t* d, const uint16_t* mn, int64_t nb,
                                                                     const float* dx, const float* sx, int64_t M,
                                                                     __m256 (*acc)[16], __m256 (*accm)[16]) {
  for (int t = 0; t < NG; ++t) {
    const __m256 dv = load_scales(d + t * nb * GROUP);
    const __m256 mv = kind == 0 ? load_scales(mn + t * nb * GROUP) : _mm256_setzero_ps();
    for (int64_t m = 0; m < M; ++m) {
      const __m256i isum = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums[t][m]));
      const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(dx[m * nb]));
      acc[t][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[t][m]);
      if (kind == 0) accm[t][m] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sx[m * nb]), accm[t][m]);
    }
  }
}

// affine4's block of a group (four 32-byte chunks of two nibbles) as the 8 x 32 bytes of a tile:
// row t < 4 the low nibbles of chunk t, row t + 4 its high nibbles (inputs 4 t + k and 16 + 4 t + k).
__attribute__((target("avx2,fma,f16c"))) inline void amx_unpack_affine4(const uint8_t* wb, uint8_t* out) {
  const __m256i lo = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * c), _mm256_and_si256(b, lo));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * (c + 4)), _mm256_and_si256(_mm256_srli_epi16(b, 4), lo));
  }
}

// Groups g .. g + NG - 1 against rows r0 .. r0 + M - 1 (the tiles configured for M rows).
template <int kind, int NG>
__attribute__((target("avx2,fma,f16c,amx-tile,amx-int8"))) void groups_rows_amx(const uint8_t* qw, const uint16_t* dw,
                                                                                const uint16_t* mw, int64_t nb,
                                                                                const QuantX& qx, int64_t I, int64_t O,
                                                                                float* y, int64_t g, int64_t r0,
                                                                                int64_t M) {
  const int64_t chunk_bytes = kind == 0 ? 128 : 256, group_bytes = nb * chunk_bytes;
  __m256 acc[NG][16], accm[NG][16];
  for (int t = 0; t < NG; ++t)
    for (int64_t m = 0; m < M; ++m) acc[t][m] = accm[t][m] = _mm256_setzero_ps();
  // affine4's blocks unpacked to bytes one block ahead (the tile load then finds them written)
  alignas(64) uint8_t unpacked[2][NG][256];
  alignas(64) int32_t sums[2][NG][16][GROUP];  // two blocks in flight: j's tiles, j - 1's floats
  const float* dx = qx.d.data() + r0 * nb;
  const float* sx = qx.s.data() + r0 * nb;
  auto scale_block = [&](int64_t j) {
    amx_scale_block<kind, NG>(sums[j & 1], dw + (g * nb + j) * GROUP, kind == 0 ? mw + (g * nb + j) * GROUP : nullptr,
                              nb, dx + j, sx + j, M, acc, accm);
  };
  auto unpack = [&](int64_t j) {
    for (int t = 0; t < NG; ++t) amx_unpack_affine4(qw + (g + t) * group_bytes + j * chunk_bytes, unpacked[j & 1][t]);
  };
  if (kind == 0 && nb > 0) unpack(0);
  for (int64_t j = 0; j < nb; ++j) {
    const uint8_t* blocks[NG];
    for (int t = 0; t < NG; ++t)
      blocks[t] = kind == 0 ? unpacked[j & 1][t] : qw + (g + t) * group_bytes + j * chunk_bytes;
    // tile numbers are literals in the intrinsics' assembly: one statement per group
    _tile_loadd(0, qx.q.data() + r0 * I + j * QBLOCK, I);
#define SPECDEC_AMX_LOAD(T, TB, TC) \
  if (NG > T) {                     \
    _tile_zero(TC);                 \
    _tile_loadd(TB, blocks[T], 32); \
  }
#define SPECDEC_AMX_DOT(T, TB, TC) \
  if (NG > T) {                    \
    if (kind == 0)                 \
      _tile_dpbsud(TC, 0, TB);     \
    else                           \
      _tile_dpbssd(TC, 0, TB);     \
  }
#define SPECDEC_AMX_STORE(T, TB, TC) \
  if (NG > T) _tile_stored(TC, sums[j & 1][T], GROUP * sizeof(int32_t));
    SPECDEC_AMX_LOAD(0, 1, 4)
    SPECDEC_AMX_LOAD(1, 2, 5)
    SPECDEC_AMX_LOAD(2, 3, 6)
    SPECDEC_AMX_DOT(0, 1, 4)
    SPECDEC_AMX_DOT(1, 2, 5)
    SPECDEC_AMX_DOT(2, 3, 6)
    if (kind == 0 && j + 1 < nb) unpack(j + 1);  // while the tile unit works on block j
    if (j > 0) scale_block(j - 1);
    SPECDEC_AMX_STORE(0, 1, 4)
    SPECDEC_AMX_STORE(1, 2, 5)
    SPECDEC_AMX_STORE(2, 3, 6)
#undef SPECDEC_AMX_LOAD
#undef SPECDEC_AMX_DOT
#undef SPECDEC_AMX_STORE
  }
  if (nb > 0) scale_block(nb - 1);
  for (int t = 0; t < NG; ++t) {
    const int64_t valid = std::min<int64_t>(GROUP, O - (g + t) * GROUP);
    for (int64_t m = 0; m < M; ++m)
      store_group(y + (r0 + m) * O + (g + t) * GROUP, _mm256_add_ps(acc[t][m], accm[t][m]), valid);
  }
}

// Groups g0 .. g1 - 1 for every row: three groups at a time, then 16 rows at a time.
__attribute__((target("amx-tile,amx-int8"))) void groups_amx(int kind, const uint8_t* qw, const uint16_t* dw,
                                                             const uint16_t* mw, int64_t nb, const QuantX& qx,
                                                             int64_t R, int64_t I, int64_t O, float* y, int64_t g0,
                                                             int64_t g1) {
  using Kernel = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, const QuantX&, int64_t, int64_t,
                          float*, int64_t, int64_t, int64_t);
  static constexpr Kernel kernels[2][3] = {{groups_rows_amx<0, 1>, groups_rows_amx<0, 2>, groups_rows_amx<0, 3>},
                                           {groups_rows_amx<1, 1>, groups_rows_amx<1, 2>, groups_rows_amx<1, 3>}};
  int64_t configured = 0;
  for (int64_t g = g0; g < g1;) {
    const int64_t ng = std::min<int64_t>(3, g1 - g);
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
      const int64_t M = std::min<int64_t>(16, R - r0);
      if (M != configured) load_tiles(configured = M);
      kernels[kind][ng - 1](qw, dw, mw, nb, qx, I, O, y, g, r0, M);
    }
    g += ng;
  }
  _tile_release();
}
#endif

// x [R, I] float32; qw uint8 [G, I / 32, 128 or 256]; dw float16 [G, I / 32, 8]; mw like dw
// (affine4 only); out_features O <= 8 G.  Returns [R, O].
at::Tensor packed_linear_int8_cpu(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& dw,
                                  const c10::optional<at::Tensor>& mw, int64_t kind, int64_t out_features,
                                  int64_t isa) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat, "packed_linear_int8: x must be float32 [R, I]");
  TORCH_CHECK_VALUE(x.device().is_cpu(), "packed_linear_int8: CPU tensors only");
  const at::Tensor wc = qw.contiguous(), dc = dw.contiguous();
  const c10::optional<at::Tensor> mc = given(mw) ? c10::optional<at::Tensor>(mw->contiguous()) : c10::nullopt;
  const Int8Weight w = int8_check(x.size(1), wc, dc, mc, kind, out_features);
  const int64_t path = int8_path(isa);
  const int64_t R = x.size(0), O = w.O;
  at::Tensor y = at::empty({R, O}, x.options());
  if (R == 0 || O == 0) return y;
  const at::Tensor xc = x.contiguous();
  QuantX qx;
  int8_reserve(qx, R, w.I);
  // blocks split over threads past 256 of them (each block alone: the split changes nothing)
  at::parallel_for(0, R * w.nb, 256,
                   [&](int64_t b0, int64_t b1) { int8_quantize(path, xc.data_ptr<float>(), b0, b1, qx); });
  float* yp = y.data_ptr<float>();
  // about 64 KiB of weight codes per task
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (w.nb * (w.kind == 0 ? 128 : 256)));
  at::parallel_for(0, w.G, grain, [&](int64_t g0, int64_t g1) { int8_groups(path, w, qx, R, yp, g0, g1); });
  return y;
}

// The isa levels of packed_linear_int8 this CPU runs (1 portable, 2 AVX2, 3 AVX-512 VNNI, 4 AMX).
std::vector<int64_t> packed_linear_int8_isas_cpu() {
  std::vector<int64_t> out;
  for (int64_t isa : {ISA_PORTABLE, ISA_AVX2, ISA_AVX512_VNNI, ISA_AMX})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

}  // namespace

Int8Weight int8_check(int64_t I, const at::Tensor& qw, const at::Tensor& dw, const c10::optional<at::Tensor>& mw,
                      int64_t kind, int64_t out_features) {
  TORCH_CHECK_VALUE(kind == 0 || kind == 1, "packed_linear_int8: kind must be 0 (affine4) or 1 (scaled8), got ", kind);
  const int64_t nb = I / QBLOCK, O = out_features;
  TORCH_CHECK_VALUE(I % QBLOCK == 0 && I > 0,
                    "packed_linear_int8: the input size must be a positive multiple of 32, got ", I);
  TORCH_CHECK_VALUE(
      qw.dim() == 3 && qw.scalar_type() == at::kByte && qw.size(1) == nb && qw.size(2) == (kind == 0 ? 128 : 256),
      "packed_linear_int8: qw must be uint8 [groups, ", nb, ", ", kind == 0 ? 128 : 256, "]");
  const int64_t G = qw.size(0);
  TORCH_CHECK_VALUE(O >= 0 && O <= G * GROUP && O > (G - 1) * GROUP,
                    "packed_linear_int8: out_features must lie in (8 (groups - 1), 8 groups], got ", O, " for ", G,
                    " groups");
  TORCH_CHECK_VALUE(
      dw.scalar_type() == at::kHalf && dw.dim() == 3 && dw.size(0) == G && dw.size(1) == nb && dw.size(2) == GROUP,
      "packed_linear_int8: dw must be float16 [groups, I / 32, 8]");
  TORCH_CHECK_VALUE(kind == 1 || (given(mw) && mw->scalar_type() == at::kHalf && mw->sizes() == dw.sizes()),
                    "packed_linear_int8: affine4 needs mw, float16 [groups, I / 32, 8]");
  TORCH_CHECK_VALUE(qw.device().is_cpu() && dw.device().is_cpu() && (kind == 1 || mw->device().is_cpu()),
                    "packed_linear_int8: CPU tensors only");
  TORCH_CHECK_VALUE(qw.is_contiguous() && dw.is_contiguous() && (kind == 1 || mw->is_contiguous()),
                    "packed_linear_int8: the weight tensors must be contiguous");
  return Int8Weight{qw.data_ptr<uint8_t>(),
                    reinterpret_cast<const uint16_t*>(dw.data_ptr<at::Half>()),
                    kind == 0 ? reinterpret_cast<const uint16_t*>(mw->data_ptr<at::Half>()) : nullptr,
                    int(kind),
                    I,
                    nb,
                    G,
                    O};
}

int64_t int8_path(int64_t isa) {
  TORCH_CHECK_VALUE(isa >= ISA_BEST && isa <= ISA_LAST, "packed_linear_int8: isa must lie in 0..4, got ", isa);
  int64_t path = isa;
  if (path == ISA_BEST)
    path = isa_supported(ISA_AVX512_VNNI) ? ISA_AVX512_VNNI : isa_supported(ISA_AVX2) ? ISA_AVX2 : ISA_PORTABLE;
  TORCH_CHECK_VALUE(isa_supported(path), "packed_linear_int8: this CPU cannot run isa ", path);
  return path;
}

void int8_reserve(QuantX& q, int64_t R, int64_t I) {
  const int64_t blocks = R * (I / QBLOCK);
  if (static_cast<int64_t>(q.q.size()) < R * I) q.q.resize(R * I);
  if (static_cast<int64_t>(q.d.size()) < blocks) {
    q.d.resize(blocks);
    q.s.resize(blocks);
    q.qsum.resize(blocks);
  }
}

void int8_quantize(int64_t path, const float* x, int64_t b0, int64_t b1, QuantX& q) {
#ifdef SPECDEC_X86
  if (path != ISA_PORTABLE) return quantize_blocks_avx2(x, b0, b1, q);
#endif
  quantize_blocks_portable(x, b0, b1, q);
}

void int8_groups(int64_t path, const Int8Weight& w, const QuantX& q, int64_t R, float* y, int64_t g0, int64_t g1) {
#ifdef SPECDEC_AMX
  if (path == ISA_AMX) return groups_amx(w.kind, w.qw, w.dw, w.mw, w.nb, q, R, w.I, w.O, y, g0, g1);
#endif
#ifdef SPECDEC_X86
  if (path != ISA_PORTABLE) return groups_simd(path, w.kind, w.qw, w.dw, w.mw, w.nb, q, R, w.I, w.O, y, g0, g1);
#endif
  groups_portable(w.kind, w.qw, w.dw, w.mw, w.nb, q, R, w.I, w.O, y, g0, g1);
}

}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec_engine, CPU, m) { m.impl("packed_linear_int8", &specdec::packed_linear_int8_cpu); }

// No tensor argument to dispatch on: declared with its function (the one schema outside extension.cpp).
TORCH_LIBRARY_FRAGMENT(specdec_engine, m) {
  m.def("packed_linear_int8_isas() -> int[]", &specdec::packed_linear_int8_isas_cpu);
}
