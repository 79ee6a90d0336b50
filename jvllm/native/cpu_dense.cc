// x @ W.T for rows x [R, I] and a weight W [O, I] of the same dtype (bfloat16 or float32) that
// is layer `layer` of a stack [L, O, I], on XLA:CPU through the XLA FFI
// (quantization/cpu_dense.py builds it; with -DJVLLM_NO_BF16, for a CPU without AVX-512 BF16,
// float32 only).
//
// Inside the layer scan XLA:CPU copies a layer's slice out of the stack before its matmul, and
// its matmul of a row or two reads a weight well below the bandwidth a sum over it reaches;
// this kernel reads the layer where it lies. Each row of x meets a weight row a vector at a
// time (AVX-512 BF16 dot products of 32 values, or float32 fused multiply-adds of 16), each
// (row, output) pair summing in float32 in two vectors: independent chains, so that a single
// row keeps up with the weight streaming in.
// - Up to kStreamRows rows, one weight row after the other meets every row of x, so that the
//   weight streams through the cache in order (four weight rows read side by side ran at half
//   the read bandwidth): a decode step of a few sequences is bound by that read.
// - Past it, a tile of kTileOuts weight rows meets the rows of x kTileRows at a time: a decode
//   step of tens of sequences is bound by the products, and XLA:CPU copies the layer out of
//   the stack before its matmul (BENCHMARKS.md, "The CPU dense kernel past 8 rows").
// A pair's sum is the same either way, so a row's products do not depend on its batch. Weight
// rows are split among XLA's intra-op threads.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kAcc = 2;          // vectors each (row, output) pair sums in
constexpr int kStreamRows = 8;   // rows that meet one weight row at a time
constexpr int kTileRows = 2;     // past kStreamRows: rows of x ...
constexpr int kTileOuts = 4;     // ... against weight rows at a time (16 sums in registers)
constexpr int kMaxRows = 64;     // cpu_dense.py's MAX_ROWS

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

// Adds the products of kRows rows of x with kOuts weight rows at k to acc[.][.][a].
template <typename D, int kRows, int kOuts>
inline void add_products(__m512 (&acc)[kRows][kOuts][kAcc], int a, const typename D::Value* x,
                         const typename D::Value* w, int64_t I, int64_t k) {
  decltype(D::load(w)) wk[kOuts];
  for (int o = 0; o < kOuts; ++o) wk[o] = D::load(w + o * I + k);
  for (int r = 0; r < kRows; ++r) {
    const auto xk = D::load(x + r * I + k);
    for (int o = 0; o < kOuts; ++o) acc[r][o][a] = D::add_product(acc[r][o][a], xk, wk[o]);
  }
}

// y[r * O + o] = x[r] . w[o] for r < kRows and o < kOuts. Every pair sums in the same order
// whatever kRows and kOuts.
template <typename D, int kRows, int kOuts>
inline void dense_tile(const typename D::Value* x, const typename D::Value* w, int64_t I,
                       int64_t O, float* y) {
  constexpr int kStep = D::kStep;
  __m512 acc[kRows][kOuts][kAcc];
  for (int r = 0; r < kRows; ++r) {
    for (int o = 0; o < kOuts; ++o) {
      for (int a = 0; a < kAcc; ++a) acc[r][o][a] = _mm512_setzero_ps();
    }
  }
  int64_t k = 0;
  for (; k + kAcc * kStep <= I; k += kAcc * kStep) {
    for (int a = 0; a < kAcc; ++a) add_products<D>(acc, a, x, w, I, k + a * kStep);
  }
  for (; k < I; k += kStep) add_products<D>(acc, 0, x, w, I, k);
  for (int r = 0; r < kRows; ++r) {
    for (int o = 0; o < kOuts; ++o) {
      __m512 sum = acc[r][o][0];
      for (int a = 1; a < kAcc; ++a) sum = _mm512_add_ps(sum, acc[r][o][a]);
      y[r * O + o] = _mm512_reduce_add_ps(sum);
    }
  }
}

// Up to kStreamRows rows against weight rows [o_first, o_last), one weight row at a time.
template <typename D, int kRows>
void stream_rows(int64_t o_first, int64_t o_last, const typename D::Value* x,
                 const typename D::Value* w, int64_t I, int64_t O, float* y) {
  for (int64_t o = o_first; o < o_last; ++o) dense_tile<D, kRows, 1>(x, w + o * I, I, O, y + o);
}

// All R rows against the kOuts weight rows at w.
template <typename D, int kOuts>
void tile_rows(int64_t R, const typename D::Value* x, const typename D::Value* w, int64_t I,
               int64_t O, float* y) {
  int64_t r = 0;
  for (; r + kTileRows <= R; r += kTileRows) {
    dense_tile<D, kTileRows, kOuts>(x + r * I, w, I, O, y + r * O);
  }
  for (; r < R; ++r) dense_tile<D, 1, kOuts>(x + r * I, w, I, O, y + r * O);
}

// The R rows of x against weight rows [o_first, o_last).
template <typename D>
void dense_range(int64_t R, int64_t o_first, int64_t o_last, const typename D::Value* x,
                 const typename D::Value* w, int64_t I, int64_t O, float* y) {
  switch (R) {
    case 1: return stream_rows<D, 1>(o_first, o_last, x, w, I, O, y);
    case 2: return stream_rows<D, 2>(o_first, o_last, x, w, I, O, y);
    case 3: return stream_rows<D, 3>(o_first, o_last, x, w, I, O, y);
    case 4: return stream_rows<D, 4>(o_first, o_last, x, w, I, O, y);
    case 5: return stream_rows<D, 5>(o_first, o_last, x, w, I, O, y);
    case 6: return stream_rows<D, 6>(o_first, o_last, x, w, I, O, y);
    case 7: return stream_rows<D, 7>(o_first, o_last, x, w, I, O, y);
    case 8: return stream_rows<D, 8>(o_first, o_last, x, w, I, O, y);
  }
  int64_t o = o_first;
  for (; o + kTileOuts <= o_last; o += kTileOuts) {
    tile_rows<D, kTileOuts>(R, x, w + o * I, I, O, y + o);
  }
  for (; o < o_last; ++o) tile_rows<D, 1>(R, x, w + o * I, I, O, y + o);
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
    return ffi::Error::InvalidArgument("dense: x [1 <= R <= 64, I]");
  }
  const int64_t R = x_dims[0];
  const auto* xs = reinterpret_cast<const typename D::Value*>(x.typed_data());
  const auto* w = reinterpret_cast<const typename D::Value*>(weights.typed_data()) + at * O * I;
  float* out = y->typed_data();
  // Past kStreamRows the ranges are whole tiles of weight rows, bar the last.
  const int64_t unit = R <= kStreamRows ? 1 : kTileOuts, num_units = (O + unit - 1) / unit;
  jvllm::parallel_ranges(pool, num_units, 8, num_units, [&](int64_t first, int64_t last) {
    dense_range<D>(R, first * unit, std::min(last * unit, O), xs, w, I, O, out);
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
