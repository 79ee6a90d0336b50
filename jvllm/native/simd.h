// The portable SIMD layer of the CPU kernels, in two parts:
// - simd_lanes.h, over std::experimental::simd (libstdc++'s, GCC 11 and later): the machine's
//   float vector and the loads that widen a weight's bfloat16 or int8 values into it (cpu_dense.cc,
//   cpu_int8.cc through dense_tile.h; docs/design.md, "Native CPU kernels", says why this layer);
//   apart, so that a compiler without <experimental/simd> still builds the other kernels;
// - here, GCC/Clang vectors of the machine's float width and the few operations that x86 does
//   better with an intrinsic than the generic vector code GCC 12 makes of them (cpu_int_group.cc,
//   written before the first part), the lane count N, and the instruction set's name.
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

// GCC/Clang vector types of N lanes, N the machine's float vector (AVX-512 16, AVX 8, else
// 4): wider ones than the machine has compile to slow code (AVX2 ran 64-byte vectors 20x
// slower).
#if defined(__AVX512F__)
constexpr int N = 16;
#elif defined(__AVX__)
constexpr int N = 8;
#else
constexpr int N = 4;
#endif
typedef float f32v __attribute__((vector_size(4 * N)));
typedef int32_t i32v __attribute__((vector_size(4 * N)));
typedef uint32_t u32v __attribute__((vector_size(4 * N)));

template <typename V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// a * b + c, rounded once where the CPU has FMA: the kernels' sums of products, in the
// order each kernel chooses.
inline f32v multiply_add(f32v a, f32v b, f32v c) {
#if defined(__AVX512F__)
  return (f32v)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX__) && defined(__FMA__)
  return (f32v)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// N bytes at p as 32-bit lanes (kSigned: the bytes as int8), where the bit work happens (x86
// has no byte shifts). GCC 12 widens a vector of bytes one lane at a time, so x86 gets its
// extending load.
template <bool kSigned = false>
inline i32v widen(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (i32v)(kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (i32v)(kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
  i32v q;
  for (int l = 0; l < N; ++l) q[l] = kSigned ? static_cast<int8_t>(p[l]) : p[l];
  return q;
#endif
}

inline f32v to_f32(i32v q) { return __builtin_convertvector(q, f32v); }

// x in every lane.
inline f32v splat(float x) {
#if defined(__AVX512F__)
  return (f32v)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (f32v)_mm256_set1_ps(x);
#else
  return f32v{x, x, x, x};
#endif
}

// The sum of v's lanes, halves added in a tree: adding them one after another, each waiting on
// the last, took a quarter of a one-row product of a 576-wide row.
inline float sum_lanes(f32v v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX__)
  __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
#else
  return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

}  // namespace
