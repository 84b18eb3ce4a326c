// 8-float vectors in GCC's vector extension, shared by the CPU kernels written with them
// (tree attention's online softmax, the engine layer's SiLU): loads, stores and a branch-free exp.
// A function using them gets the instruction set it is compiled for: one AVX register per
// vector in an FMA clone (SPECDEC_TARGET_CLONES), two SSE registers in baseline x86-64 code.
#pragma once

#include <cstdint>
#include <cstring>

namespace specdec {

// the helpers are inlined into each function (and clone) using them, so compiled for its
// target; out of line they would be baseline code passing vectors through memory
#define SPECDEC_INLINE inline __attribute__((always_inline))

// 8 floats in one vector (GCC vector extension: one AVX register in the FMA clone, two SSE
// registers in the baseline one); loads and stores through memcpy, no alignment needed.
typedef float v8sf __attribute__((vector_size(32)));

SPECDEC_INLINE v8sf load8(const float* p) {
  v8sf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

SPECDEC_INLINE void store8(float* p, v8sf x) { std::memcpy(p, &x, sizeof(x)); }

typedef int32_t v8si __attribute__((vector_size(32)));

// exp(x) of 8 floats x <= 0 in branch-free vector arithmetic (Cody-Waite range reduction
// x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n through the exponent
// bits); relative error about 2e-7.  x below -87 (and -inf) gives 0.
SPECDEC_INLINE v8sf exp8_nonpos(v8sf x) {
  const v8sf zero = v8sf{0, 0, 0, 0, 0, 0, 0, 0}, lo = zero - 87.0f;
  const v8si under = x < lo;
  const v8sf xc = under ? lo : x;
  // round to nearest through the 1.5 * 2^23 trick (no rounding instruction needed; |x| < 2^22)
  const v8sf n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const v8sf r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  v8sf p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const v8si bits = (__builtin_convertvector(n, v8si) + 127) << 23;
  v8sf scale;  // 2^n: `bits` read as floats (memcpy: a bit cast that breaks no aliasing rule)
  std::memcpy(&scale, &bits, sizeof(scale));
  const v8sf res = p * scale;
  return under ? zero : res;
}

}  // namespace specdec
