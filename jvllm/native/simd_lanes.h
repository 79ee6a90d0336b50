// The CPU kernels' portable SIMD layer (simd.h holds what they share beside it):
// std::experimental::simd's float vector of the machine and the loads that widen a weight's
// bfloat16 or int8 values into it, which GCC compiles to x86's widening loads and NEON's shifts
// by itself, and the few operations kept as intrinsics beside their portable lines. Every
// kernel includes it (the dense and int8 kernels through dense_tile.h): with a compiler
// without <experimental/simd> (GCC before 11, libc++) none builds, and the pure-JAX paths run.
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
// JVLLM_UNROLLED (simd.h) unrolls the loops over a tile's rows, outputs and sums.
namespace stdx = std::experimental;
using vf32 = stdx::native_simd<float>;
using vu32 = stdx::rebind_simd_t<uint32_t, vf32>;
using vi32 = stdx::rebind_simd_t<int32_t, vf32>;
constexpr int kLanes = vf32::size();
// The target's vector registers: AVX-512's and ARM64's 32, AVX2's 16.
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kRegisters = 32;
#else
constexpr int kRegisters = 16;
#endif

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

// a * b + c, rounded once where the CPU has FMA. Through the instruction itself: GCC 12's
// stdx::fma is a call a vector for AVX-512 and NEON (with -ffast-math), its lanes' generator
// left out of line (the decode kernel's AVX-512 scores 4x slower); and a * b + c is fused only
// under -ffast-math, not in the builder's ISO C++.
JVLLM_INLINE vf32 multiply_add(vf32 a, vf32 b, vf32 c) {
#if defined(__AVX512F__)
  return vf32(_mm512_fmadd_ps(static_cast<__m512>(a), static_cast<__m512>(b),
                              static_cast<__m512>(c)));
#elif defined(__AVX__) && defined(__FMA__)
  return vf32(_mm256_fmadd_ps(static_cast<__m256>(a), static_cast<__m256>(b),
                              static_cast<__m256>(c)));
#elif defined(__ARM_NEON) && defined(__aarch64__)
  return vf32(vfmaq_f32(static_cast<float32x4_t>(c), static_cast<float32x4_t>(a),
                        static_cast<float32x4_t>(b)));
#else
  return a * b + c;
#endif
}

JVLLM_INLINE float sum_lanes(vf32 v) { return stdx::reduce(v); }

// r[kLanes] -> lane j the sum of r[j]'s lanes: kLanes sums of lanes at once, in a tree of
// additions of lanes paired by shuffles (AVX2 and NEON's pairwise additions, AVX-512's unpacks),
// where GCC makes no such tree of the portable line, one sum at a time (the decode kernel's
// compute-bound scores 1.2x slower on AVX-512 that way, 1.05-1.1x on AVX2;
// docs/benchmarks/cpu_kernels.md).
JVLLM_INLINE vf32 transpose_sum(const vf32 (&r)[kLanes]) {
#if defined(__AVX512F__)
  __m512 a[8], b[4];
  // per 128 bits: lanes 0, 2 sum r[2i]'s, lanes 1, 3 r[2i + 1]'s
  JVLLM_UNROLLED for (int i = 0; i < 8; ++i) {
    const __m512 x = static_cast<__m512>(r[2 * i]), y = static_cast<__m512>(r[2 * i + 1]);
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  JVLLM_UNROLLED for (int i = 0; i < 4; ++i) {  // per 128 bits: lane j sums r[4i + j]'s
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // 128-bit lane k of the result: b[k]'s four 128-bit lanes summed
  const __m512 b01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                   _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 b23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                   _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return vf32(_mm512_add_ps(_mm512_shuffle_f32x4(b01, b23, 0x88),
                            _mm512_shuffle_f32x4(b01, b23, 0xDD)));
#elif defined(__AVX__)
  __m256 v[8];
  JVLLM_UNROLLED for (int i = 0; i < 8; ++i) v[i] = static_cast<__m256>(r[i]);
  // per 128 bits: lane j sums r[j]'s (r[4 + j]'s) four lanes of that half
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return vf32(_mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                            _mm256_permute2f128_ps(low, high, 0x31)));
#elif defined(__ARM_NEON) && defined(__aarch64__)
  float32x4_t v[4];
  JVLLM_UNROLLED for (int i = 0; i < 4; ++i) v[i] = static_cast<float32x4_t>(r[i]);
  return vf32(vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3])));
#else
  return vf32([&](auto j) { return stdx::reduce(r[j]); });
#endif
}

// v's lanes rounded to the nearest bfloat16 (ties to even; finite lanes) as their 16 bits at dst.
JVLLM_INLINE void store_bfloat16(vf32 v, uint16_t* dst) {
  const vu32 bits = stdx::__proposed::simd_bit_cast<vu32>(v);
  const vu32 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  stdx::static_simd_cast<stdx::rebind_simd_t<uint16_t, vf32>>(rounded).copy_to(
      dst, stdx::element_aligned);
}

// kLanes bytes at p as 32-bit lanes (kSigned: the bytes as int8), where the GGUF and
// grouped-integer kernels' bit work happens. x86 through its extending loads: GCC 12's code of
// the portable converting load made Q6_K's one-row products 1.1x slower on AVX-512.
template <bool kSigned = false>
JVLLM_INLINE vi32 widen_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return vi32(kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return vi32(kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
  if constexpr (kSigned) {
    return vi32(reinterpret_cast<const int8_t*>(p), stdx::element_aligned);
  } else {
    return vi32(p, stdx::element_aligned);
  }
#endif
}

JVLLM_INLINE vf32 to_floats(vi32 q) { return stdx::static_simd_cast<vf32>(q); }

// Lanes of bytes (0-255) holding float8 e4m3fn values as float32, exactly (load_e4m3's
// portable path): a normal value's bits moved into float32's fields and its exponent rebiased,
// a subnormal (m * 2^-9) made from its integer, NaN made float32's quiet NaN.
JVLLM_INLINE vf32 e4m3_lanes(vi32 q) {
  using stdx::__proposed::simd_bit_cast;
  const vi32 magnitude = q & 0x7F;
  vi32 bits = (magnitude << 20) + ((127 - 7) << 23);
  stdx::where(magnitude < 8, bits) = simd_bit_cast<vi32>(to_floats(magnitude) * 0x1p-9f);
  stdx::where(magnitude == 0x7F, bits) = 0x7FC00000;
  const vu32 sign = (simd_bit_cast<vu32>(q) & 0x80u) << 24;
  return as_floats(simd_bit_cast<vu32>(bits) | sign);
}

// 2 * kLanes float8 e4m3fn values at p (sign, 4 exponent bits of bias 7, 3 mantissa bits; no
// infinities, 0x7F and 0xFF NaN) as float32, exactly, the first kLanes in `low`. Where x86 has
// float16 conversions, a byte's bits moved into float16's fields in 16-bit lanes are its value
// times 2^-8, subnormals included, the NaN bytes made float16's quiet NaN, and the conversion
// widens them: integer lanes and a conversion, which denormals-are-zero does not touch as it
// would a multiply of subnormals, in half the instructions of e4m3_lanes.
JVLLM_INLINE void load_e4m3(const uint8_t* p, vf32& low, vf32& high) {
#if defined(__AVX512BW__)
  const __m512i bytes =
      _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i seven_bits = _mm512_set1_epi16(0x7F);
  // s eeee mmm -> float16's s 0eeee mmm0000000: the sign shifted in twice, once cleared
  __m512i halves = _mm512_srai_epi16(_mm512_slli_epi16(bytes, 8), 1);
  halves = _mm512_and_si512(halves, _mm512_set1_epi16(static_cast<int16_t>(0xBFFF)));
  // the NaN bytes' 0x3F80 -> 0x7E00, the sign kept; a branch, as no weight is NaN (their
  // masked move took 10-15% of a one-row product)
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(bytes, seven_bits), seven_bits);
  if (__builtin_expect(nan != 0, 0)) {
    const __m512i nans = _mm512_xor_si512(halves, _mm512_set1_epi16(0x3F80 ^ 0x7E00));
    halves = _mm512_mask_mov_epi16(halves, nan, nans);
  }
  low = vf32(_mm512_cvtph_ps(_mm512_castsi512_si256(halves))) * 256.f;
  high = vf32(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1))) * 256.f;
#elif defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
  const __m256i bytes =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i seven_bits = _mm256_set1_epi16(0x7F);
  __m256i halves = _mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 1);
  halves = _mm256_and_si256(halves, _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(bytes, seven_bits), seven_bits);
  if (__builtin_expect(_mm256_movemask_epi8(nan) != 0, 0)) {
    halves = _mm256_xor_si256(halves, _mm256_and_si256(nan, _mm256_set1_epi16(0x3F80 ^ 0x7E00)));
  }
  low = vf32(_mm256_cvtph_ps(_mm256_castsi256_si128(halves))) * 256.f;
  high = vf32(_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1))) * 256.f;
#else
  low = e4m3_lanes(widen_bytes(p));
  high = e4m3_lanes(widen_bytes(p + kLanes));
#endif
}

// Each lane rounded to the nearest bfloat16 (ties to even) in integer arithmetic, NaN kept. The
// NaN test compares the magnitudes as signed lanes: AVX2 has no unsigned compare, and GCC 12's
// code of one made the grouped-integer kernel's bfloat16 scales 1.05x slower.
JVLLM_INLINE vf32 round_bits_to_bfloat16(vf32 w) {
  using stdx::__proposed::simd_bit_cast;
  const vu32 bits = simd_bit_cast<vu32>(w);
  const vu32 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  const vi32 magnitude = simd_bit_cast<vi32>(bits & 0x7FFFFFFFu);
  vi32 out = simd_bit_cast<vi32>(rounded);
  stdx::where(magnitude > 0x7F800000, out) = simd_bit_cast<vi32>(bits);
  return simd_bit_cast<vf32>(out);
}

// The kLanes values of `rounded`, each already a bfloat16 value, as their 16 bits at dst
// (exact; NaN kept). AVX-512 narrows with its instruction: GCC 12's code of the portable line
// made a bfloat16 layer's dequantization 1.07x slower.
JVLLM_INLINE void store_rounded(vf32 rounded, uint16_t* dst) {
  const vu32 bits = stdx::__proposed::simd_bit_cast<vu32>(rounded) >> 16;
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm512_cvtepi32_epi16(static_cast<__m512i>(bits)));
#else
  stdx::static_simd_cast<stdx::rebind_simd_t<uint16_t, vf32>>(bits).copy_to(
      dst, stdx::element_aligned);
#endif
}

}  // namespace
