// x @ W.T for up to 8 bfloat16 rows x [R, I] and a bfloat16 weight W [O, I] that is layer
// `layer` of a stack [L, O, I], on XLA:CPU through the XLA FFI (cpu_bf16.py builds it).
//
// Inside the layer scan XLA:CPU copies a layer's slice out of the stack before its matmul, and
// its matmul of a row or two reads a weight at a third of the bandwidth a sum over it reaches;
// this kernel reads the layer where it lies, one weight row after the other, so that the
// weight streams through the cache in order (four rows read side by side ran at half the read
// bandwidth). Each row of x meets the weight row with AVX-512 BF16 dot products (32 products
// an instruction), summing in float32 in two vectors: independent chains, so that a single row
// keeps up with the weight streaming in. Weight rows are split among XLA's intra-op threads.

#include <immintrin.h>

#include <cstdint>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kStep = 32;    // values of a row one instruction takes
constexpr int kAcc = 2;      // vectors each (row, output) pair sums in
constexpr int kMaxRows = 8;  // cpu_bf16.py's MAX_ROWS

inline __m512bh load_bfloat16(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// y[r * O + o] = x[r] . w[o] for the kRows rows of x and weight rows [o_first, o_last). Every
// row sums in the same order whatever kRows, so a sequence's products do not depend on what
// shares its batch.
template <int kRows>
void dense_rows(int64_t o_first, int64_t o_last, const uint16_t* x, const uint16_t* w, int64_t I,
                int64_t O, float* y) {
  for (int64_t o = o_first; o < o_last; ++o) {
    const uint16_t* row = w + o * I;
    __m512 acc[kRows][kAcc];
    for (int r = 0; r < kRows; ++r) {
      for (int a = 0; a < kAcc; ++a) acc[r][a] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + kAcc * kStep <= I; k += kAcc * kStep) {
      for (int a = 0; a < kAcc; ++a) {
        const __m512bh wk = load_bfloat16(row + k + a * kStep);
        for (int r = 0; r < kRows; ++r) {
          acc[r][a] = _mm512_dpbf16_ps(acc[r][a], load_bfloat16(x + r * I + k + a * kStep), wk);
        }
      }
    }
    for (; k < I; k += kStep) {
      const __m512bh wk = load_bfloat16(row + k);
      for (int r = 0; r < kRows; ++r) {
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], load_bfloat16(x + r * I + k), wk);
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
void dense_range(int64_t R, int64_t o_first, int64_t o_last, const uint16_t* x,
                 const uint16_t* w, int64_t I, int64_t O, float* y) {
  switch (R) {
    case 1: dense_rows<1>(o_first, o_last, x, w, I, O, y); break;
    case 2: dense_rows<2>(o_first, o_last, x, w, I, O, y); break;
    case 3: dense_rows<3>(o_first, o_last, x, w, I, O, y); break;
    case 4: dense_rows<4>(o_first, o_last, x, w, I, O, y); break;
    case 5: dense_rows<5>(o_first, o_last, x, w, I, O, y); break;
    case 6: dense_rows<6>(o_first, o_last, x, w, I, O, y); break;
    case 7: dense_rows<7>(o_first, o_last, x, w, I, O, y); break;
    case 8: dense_rows<8>(o_first, o_last, x, w, I, O, y); break;
  }
}

ffi::Error bf16_dense(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> layer,
                      ffi::Buffer<ffi::BF16> weights, ffi::ResultBuffer<ffi::F32> y) {
  auto dims = weights.dimensions();
  auto x_dims = x.dimensions();
  if (dims.size() != 3 || dims[2] % kStep != 0) {
    return ffi::Error::InvalidArgument("bf16_dense: weights [L, O, I], I a multiple of 32");
  }
  const int64_t L = dims[0], O = dims[1], I = dims[2], at = layer.typed_data()[0];
  if (at < 0 || at >= L) return ffi::Error::InvalidArgument("bf16_dense: layer in [0, L)");
  if (x_dims.size() != 2 || x_dims[0] < 1 || x_dims[0] > kMaxRows || x_dims[1] != I) {
    return ffi::Error::InvalidArgument("bf16_dense: x [1 <= R <= 8, I]");
  }
  const int64_t R = x_dims[0];
  const auto* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* w = reinterpret_cast<const uint16_t*>(weights.typed_data()) + at * O * I;
  float* out = y->typed_data();
  jvllm::parallel_ranges(pool, O, 8, O, [&](int64_t first, int64_t last) {
    dense_range(R, first, last, xs, w, I, O, out);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BF16DenseStacked, bf16_dense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
