// x @ W.T for up to 8 rows x [R, I] and a weight W [O, I] of the same dtype (bfloat16 or
// float32) that is layer `layer` of a stack [L, O, I], on XLA:CPU through the XLA FFI
// (cpu_dense.py builds it; with -DJVLLM_NO_BF16, for a CPU without AVX-512 BF16, float32 only).
//
// Inside the layer scan XLA:CPU copies a layer's slice out of the stack before its matmul, and
// its matmul of a row or two reads a weight well below the bandwidth a sum over it reaches;
// this kernel reads the layer where it lies, one weight row after the other, so that the
// weight streams through the cache in order (four rows read side by side ran at half the read
// bandwidth). Each row of x meets the weight row a vector at a time (AVX-512 BF16 dot products
// of 32 values, or float32 fused multiply-adds of 16), summing in float32 in two vectors:
// independent chains, so that a single row keeps up with the weight streaming in. Weight rows
// are split among XLA's intra-op threads.

#include <immintrin.h>

#include <cstdint>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kAcc = 2;      // vectors each (row, output) pair sums in
constexpr int kMaxRows = 8;  // cpu_dense.py's MAX_ROWS

// A weight dtype: its storage, a vector of it, and a product of two vectors added to a sum.
#ifndef JVLLM_NO_BF16
struct BFloat16 {
  using Value = uint16_t;
  static constexpr int kStep = 32;  // values one instruction takes
  static __m512bh load(const Value* p) {
    return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
  }
  static __m512 add_product(__m512 acc, __m512bh x, __m512bh w) {
    return _mm512_dpbf16_ps(acc, x, w);
  }
};
#endif

struct Float32 {
  using Value = float;
  static constexpr int kStep = 16;
  static __m512 load(const Value* p) { return _mm512_loadu_ps(p); }
  static __m512 add_product(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
};

// y[r * O + o] = x[r] . w[o] for the kRows rows of x and weight rows [o_first, o_last). Every
// row sums in the same order whatever kRows, so a sequence's products do not depend on what
// shares its batch.
template <typename D, int kRows>
void dense_rows(int64_t o_first, int64_t o_last, const typename D::Value* x,
                const typename D::Value* w, int64_t I, int64_t O, float* y) {
  constexpr int kStep = D::kStep;
  for (int64_t o = o_first; o < o_last; ++o) {
    const typename D::Value* row = w + o * I;
    __m512 acc[kRows][kAcc];
    for (int r = 0; r < kRows; ++r) {
      for (int a = 0; a < kAcc; ++a) acc[r][a] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + kAcc * kStep <= I; k += kAcc * kStep) {
      for (int a = 0; a < kAcc; ++a) {
        const auto wk = D::load(row + k + a * kStep);
        for (int r = 0; r < kRows; ++r) {
          acc[r][a] = D::add_product(acc[r][a], D::load(x + r * I + k + a * kStep), wk);
        }
      }
    }
    for (; k < I; k += kStep) {
      const auto wk = D::load(row + k);
      for (int r = 0; r < kRows; ++r) {
        acc[r][0] = D::add_product(acc[r][0], D::load(x + r * I + k), wk);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      __m512 sum = acc[r][0];
      for (int a = 1; a < kAcc; ++a) sum = _mm512_add_ps(sum, acc[r][a]);
      y[r * O + o] = _mm512_reduce_add_ps(sum);
    }
  }
}

// The R rows of x against weight rows [o_first, o_last).
template <typename D>
void dense_range(int64_t R, int64_t o_first, int64_t o_last, const typename D::Value* x,
                 const typename D::Value* w, int64_t I, int64_t O, float* y) {
  switch (R) {
    case 1: dense_rows<D, 1>(o_first, o_last, x, w, I, O, y); break;
    case 2: dense_rows<D, 2>(o_first, o_last, x, w, I, O, y); break;
    case 3: dense_rows<D, 3>(o_first, o_last, x, w, I, O, y); break;
    case 4: dense_rows<D, 4>(o_first, o_last, x, w, I, O, y); break;
    case 5: dense_rows<D, 5>(o_first, o_last, x, w, I, O, y); break;
    case 6: dense_rows<D, 6>(o_first, o_last, x, w, I, O, y); break;
    case 7: dense_rows<D, 7>(o_first, o_last, x, w, I, O, y); break;
    case 8: dense_rows<D, 8>(o_first, o_last, x, w, I, O, y); break;
  }
}

template <typename D, ffi::DataType kType>
ffi::Error dense_stacked(ffi::ThreadPool pool, ffi::Buffer<kType> x, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<kType> weights, ffi::ResultBuffer<ffi::F32> y) {
  auto dims = weights.dimensions();
  auto x_dims = x.dimensions();
  if (dims.size() != 3 || dims[2] % D::kStep != 0) {
    return ffi::Error::InvalidArgument(D::kStep == 32
                                           ? "dense: weights [L, O, I], I a multiple of 32"
                                           : "dense: weights [L, O, I], I a multiple of 16");
  }
  const int64_t L = dims[0], O = dims[1], I = dims[2], at = layer.typed_data()[0];
  if (at < 0 || at >= L) return ffi::Error::InvalidArgument("dense: layer in [0, L)");
  if (x_dims.size() != 2 || x_dims[0] < 1 || x_dims[0] > kMaxRows || x_dims[1] != I) {
    return ffi::Error::InvalidArgument("dense: x [1 <= R <= 8, I]");
  }
  const int64_t R = x_dims[0];
  const auto* xs = reinterpret_cast<const typename D::Value*>(x.typed_data());
  const auto* w = reinterpret_cast<const typename D::Value*>(weights.typed_data()) + at * O * I;
  float* out = y->typed_data();
  jvllm::parallel_ranges(pool, O, 8, O, [&](int64_t first, int64_t last) {
    dense_range<D>(R, first, last, xs, w, I, O, out);
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

#ifndef JVLLM_NO_BF16
JVLLM_DENSE_STACKED(BF16DenseStacked, BFloat16, ffi::BF16)
#endif
JVLLM_DENSE_STACKED(F32DenseStacked, Float32, ffi::F32)
