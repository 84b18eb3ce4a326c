// Helpers shared by the C++ sources of the extension (torch side): the clamp that keeps every
// count and index used as an address inside its tensor, the test for an optional tensor
// argument, and the CPU-feature probes of the kernels with an x86 SIMD path.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>

// x86-64 with GCC or clang: the AVX2 / FMA paths (intrinsics, target attributes and
// __builtin_cpu_supports) are compiled, and chosen at run time with the probes below.
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SPECDEC_X86 1
// AMX intrinsics (tile loads, int8 tile dot products): GCC 11+, clang 12+, on Linux, where the
// process asks the kernel for the tile data state (arch_prctl) before its first tile instruction.
#if defined(__linux__) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#include <sys/syscall.h>
#include <unistd.h>
#define SPECDEC_AMX 1
#endif
#endif

// SPECDEC_TARGET_CLONES("fma") before a function definition: GCC function multiversioning, a
// clone of the function compiled for that instruction set beside the baseline one, picked at
// load time by the CPU: the same code, never an instruction the machine lacks.  Elsewhere
// (clang, other architectures) the baseline one only.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPECDEC_TARGET_CLONES(isa) __attribute__((target_clones(isa, "default")))
#else
#define SPECDEC_TARGET_CLONES(isa)
#endif

namespace specdec {

// v clamped into [lo, hi] (lo <= hi).
inline int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return std::min(std::max(v, lo), hi); }

// Whether an optional tensor argument (`Tensor?` in the schema) was given.
inline bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

#ifdef SPECDEC_X86
// Whether this CPU runs AVX2 instructions (asked once per process).
inline bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2");
  return ok;
}

// Whether this CPU runs AVX2 and FMA instructions (asked once per process).
inline bool cpu_has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// Whether this CPU (and its OS) runs AVX-512 F/BW/VL with VNNI (asked once per process).
inline bool cpu_has_avx512_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
}

#ifdef SPECDEC_AMX
// Whether this CPU runs AMX int8 tile instructions and the OS lets this process use them (asked
// once per process): CPUID leaf 7 (AMX-TILE, AMX-INT8), the OS's XCR0 tile state bits (17, 18),
// and Linux's permission for the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA:
// granted to the whole process; a kernel older than 5.16 refuses it, and then the answer is no).
inline bool cpu_has_amx_int8() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;  // AMX-TILE, AMX-INT8
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!((c >> 27) & 1)) return false;  // OSXSAVE: xgetbv is allowed
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return false;  // XTILECFG and XTILEDATA enabled by the OS
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}
#endif
#endif

}  // namespace specdec
