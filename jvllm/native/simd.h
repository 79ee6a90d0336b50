// The portable SIMD layer of the CPU kernels, in two parts:
// - std::experimental::simd (libstdc++'s, GCC 11 and later): the machine's float vector and the
//   loads that widen a weight's bfloat16 or int8 values into it, which GCC compiles to x86's
//   widening loads and NEON's shifts by itself (cpu_dense.cc, cpu_int8.cc; docs/design.md,
//   "Native CPU kernels", says why this layer);
// - GCC/Clang vectors of the machine's float width and the few operations that x86 does better
//   with an intrinsic than the generic vector code GCC 12 makes of them (cpu_gguf.cc,
//   cpu_int_group.cc, written before the first part).
#pragma once

#include <cstdint>
#include <cstring>
#include <experimental/simd>

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

// std::experimental::simd: vf32 is the machine's float vector (AVX-512 16 lanes, AVX 8, SSE
// and NEON 4). Its helpers, and the kernels' per-step functions over it, are always inlined:
// GCC 12 left one out of a kernel's loop, passing its vectors through memory (AVX2's bfloat16
// products 14x slower).
#define JVLLM_INLINE inline __attribute__((always_inline))
namespace stdx = std::experimental;
using vf32 = stdx::native_simd<float>;
using vu32 = stdx::rebind_simd_t<uint32_t, vf32>;
constexpr int kLanes = vf32::size();

JVLLM_INLINE vf32 as_floats(vu32 bits) { return stdx::__proposed::simd_bit_cast<vf32>(bits); }

// kLanes values from p as float32: float32 ones, bfloat16 ones (their 16 bits: a widening load
// and a shift), or int8 ones (exact; below).
JVLLM_INLINE vf32 load_lanes(const float* p) { return vf32(p, stdx::element_aligned); }

JVLLM_INLINE vf32 load_lanes(const uint16_t* p) {
  return as_floats(vu32(p, stdx::element_aligned) << 16);
}

// 2 * kLanes bfloat16 values as float32, the even ones and the odd ones: a shift and a mask of
// 32-bit lanes, no widening (the order of a sum over both is no matter).
JVLLM_INLINE void load_bfloat16_pairs(const uint16_t* p, vf32& even, vf32& odd) {
  const vu32 pairs(reinterpret_cast<const uint32_t*>(p), stdx::element_aligned);  // memcpy'd
  even = as_floats(pairs << 16);
  odd = as_floats(pairs & 0xFFFF0000u);
}

// GCC 12 widens int8 values for NEON one lane at a time, so NEON gets its widening moves;
// x86's widening load is what GCC makes of the portable line.
JVLLM_INLINE vf32 load_lanes(const int8_t* p) {
#if defined(__ARM_NEON) && defined(__aarch64__)
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  const int8x8_t bytes = vreinterpret_s8_s32(vdup_n_s32(four));
  return vf32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(bytes)))));
#else
  return vf32(p, stdx::element_aligned);
#endif
}

// a * b + c, rounded once where the CPU has FMA (std::fma elsewhere would be a library call a
// lane).
JVLLM_INLINE vf32 multiply_add(vf32 a, vf32 b, vf32 c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return stdx::fma(a, b, c);
#else
  return a * b + c;
#endif
}

JVLLM_INLINE float sum_lanes(vf32 v) { return stdx::reduce(v); }

// v's lanes rounded to the nearest bfloat16 (ties to even; finite lanes) as their 16 bits at dst.
JVLLM_INLINE void store_bfloat16(vf32 v, uint16_t* dst) {
  const vu32 bits = stdx::__proposed::simd_bit_cast<vu32>(v);
  const vu32 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  stdx::static_simd_cast<stdx::rebind_simd_t<uint16_t, vf32>>(rounded).copy_to(
      dst, stdx::element_aligned);
}

}  // namespace
