// What every CPU kernel shares beside the portable SIMD layer (simd_lanes.h, over
// std::experimental::simd; docs/design.md, "Native CPU kernels", says why that layer): the
// instruction set's name, the lane count N of the machine's float vector as the preprocessor
// knows it, an unaligned load of any type, and the unrolling pragma of tile loops.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

// The instruction set the kernel was compiled for, which the builder logs
// (jvllm/native/__init__.py).
extern "C" const char* JvllmIsa() {
#if defined(__AVX512BF16__)
  return "AVX-512 with BF16";
#elif defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "AVX2 with FMA";
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
  return "NEON with BF16";
#elif defined(__ARM_NEON)
  return "NEON";
#else
  return "no vector extension past the baseline";
#endif
}

// Loops over a tile's rows, outputs and sums, unrolled so that its sums stay in registers
// (GCC 12 kept them in memory, indexed by the loop: AVX2's bfloat16 products 14x slower).
#define JVLLM_UNROLLED _Pragma("GCC unroll 16")

namespace {

// The lanes of the machine's float vector (AVX-512 16, AVX 8, else 4): simd_lanes.h's kLanes, as
// a constant the preprocessor's targets give.
#if defined(__AVX512F__)
constexpr int N = 16;
#elif defined(__AVX__)
constexpr int N = 8;
#else
constexpr int N = 4;
#endif

template <typename V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

}  // namespace
