// x @ W.T for rows x [R, I] and a weight W [O, I] of the same dtype (bfloat16 or float32) that
// is layer `layer` of a stack [L, O, I], on XLA:CPU through the XLA FFI
// (quantization/cpu_dense.py builds it), written over the portable SIMD layer (simd_lanes.h)
// for any CPU the compiler targets.
//
// Inside the layer scan XLA:CPU copies a layer's slice out of the stack before its matmul, and
// its matmul of a row or two reads a weight well below the bandwidth a sum over it reaches;
// this kernel reads the layer where it lies, in dense_tile.h's loop: float32 fused
// multiply-adds of a vector's values, bfloat16 widened to float32 in registers (the even and
// the odd values of 32-bit lanes: a shift and a mask), or with AVX-512 BF16 its dot products
// of 32 values. Weight rows are split among XLA's intra-op threads.

#include <algorithm>
#include <cstdint>

#include "dense_tile.h"
#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 64;  // cpu_dense.py's MAX_ROWS
// cpu_dense.py's multiple of I: a multiple of every target's step (AVX-512's 32 bfloat16 values).
constexpr int kMultiple = 32;

// Each weight dtype's policy for dense_tile.h's loop: float32 values a vector a step,
using Float32 = jvllm::Widened<float, float>;

// bfloat16 values, even ones and odd ones, as float32 (the products are exact),
struct BFloat16 {
  struct Pairs {
    vf32 even, odd;
  };
  using X = uint16_t;
  using W = uint16_t;
  static constexpr int kStep = 2 * kLanes;
  JVLLM_INLINE static Pairs load_x(const uint16_t* p) {
    Pairs v;
    load_bfloat16_pairs(p, v.even, v.odd);
    return v;
  }
  JVLLM_INLINE static Pairs load_w(const uint16_t* p) { return load_x(p); }
  // The sum's chain waits on one addition a step, not on two multiply-adds.
  JVLLM_INLINE static vf32 add(vf32 acc, Pairs x, Pairs w) {
    return acc + multiply_add(x.odd, w.odd, x.even * w.even);
  }
};

#if defined(__AVX512BF16__)
// or with AVX-512 BF16, 32 products summed in pairs an instruction, where the portable path takes
// two multiply-adds and the widening (docs/benchmarks/cpu_kernels.md, "AVX2 and the portable
// layer").
struct BFloat16Dots {
  using X = uint16_t;
  using W = uint16_t;
  static constexpr int kStep = 32;
  JVLLM_INLINE static __m512bh load_x(const uint16_t* p) {
    return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
  }
  JVLLM_INLINE static __m512bh load_w(const uint16_t* p) { return load_x(p); }
  JVLLM_INLINE static vf32 add(vf32 acc, __m512bh x, __m512bh w) {
    return vf32(_mm512_dpbf16_ps(static_cast<__m512>(acc), x, w));
  }
};
using BFloat16Kernel = BFloat16Dots;
#else
using BFloat16Kernel = BFloat16;
#endif

template <typename D, ffi::DataType kType>
ffi::Error dense_stacked(ffi::ThreadPool pool, ffi::Buffer<kType> x, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<kType> weights, ffi::ResultBuffer<ffi::F32> y) {
  auto dims = weights.dimensions();
  auto x_dims = x.dimensions();
  static_assert(kMultiple % D::kStep == 0);
  if (dims.size() != 3 || dims[2] % kMultiple != 0) {
    return ffi::Error::InvalidArgument("dense: weights [L, O, I], I a multiple of 32");
  }
  const int64_t L = dims[0], O = dims[1], I = dims[2], at = layer.typed_data()[0];
  if (at < 0 || at >= L) return ffi::Error::InvalidArgument("dense: layer in [0, L)");
  if (x_dims.size() != 2 || x_dims[0] < 1 || x_dims[0] > kMaxRows || x_dims[1] != I) {
    return ffi::Error::InvalidArgument("dense: x [1 <= R <= 64, I]");
  }
  const int64_t R = x_dims[0];
  const auto* xs = reinterpret_cast<const typename D::X*>(x.typed_data());
  const auto* w = reinterpret_cast<const typename D::W*>(weights.typed_data()) + at * O * I;
  float* out = y->typed_data();
  // Past kStreamRows the ranges are whole tiles of weight rows, bar the last.
  const int64_t unit = R <= jvllm::kStreamRows ? 1 : jvllm::kTileOuts;
  const int64_t num_units = (O + unit - 1) / unit;
  jvllm::parallel_ranges(pool, num_units, 8, num_units, [&](int64_t first, int64_t last) {
    jvllm::dense_range<D>(R, first * unit, std::min(last * unit, O), xs, w, I, O, out);
  });
  return ffi::Error::Success();
}

}  // namespace

#define JVLLM_DENSE_STACKED(name, D, kType)                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (dense_stacked<D, kType>),                           \
                                ffi::Ffi::Bind()                                           \
                                    .Ctx<ffi::ThreadPool>()                                \
                                    .Arg<ffi::Buffer<kType>>()                             \
                                    .Arg<ffi::Buffer<ffi::S32>>()                          \
                                    .Arg<ffi::Buffer<kType>>()                             \
                                    .Ret<ffi::Buffer<ffi::F32>>());

// One model dtype's handler a build where the builder says which (native.dtype_flags), both
// where it does not (the tests' drivers).
#if !defined(JVLLM_MODEL_BF16) || JVLLM_MODEL_BF16
JVLLM_DENSE_STACKED(BF16DenseStacked, BFloat16Kernel, ffi::BF16)
#endif
#if !defined(JVLLM_MODEL_BF16) || !JVLLM_MODEL_BF16
JVLLM_DENSE_STACKED(F32DenseStacked, Float32, ffi::F32)
#endif
