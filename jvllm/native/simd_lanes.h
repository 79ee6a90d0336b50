// The portable half of the CPU kernels' SIMD layer (simd.h says what the other half is):
// std::experimental::simd's float vector of the machine and the loads that widen a weight's
// bfloat16 or int8 values into it, which GCC compiles to x86's widening loads and NEON's shifts
// by itself. Only the dense and int8 kernels include it (through dense_tile.h): a compiler
// without <experimental/simd> (GCC before 11, libc++) builds the others.
#pragma once

#include <cstdint>
#include <cstring>
#include <experimental/simd>

#include "simd.h"

namespace {

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
