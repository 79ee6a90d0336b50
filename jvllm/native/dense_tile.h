// Rows of x times rows of a weight in float32 sums, over the portable SIMD layer
// (simd_lanes.h): the loop of cpu_dense.cc and cpu_int8.cc, each with a policy D for its
// operands' storage.
//
// D::X and D::W store x and the weight; a step takes D::kStep values of each, loaded by
// D::load_x and D::load_w, and D::add adds their products to a float32 vector. Each (row,
// output) pair sums in kAcc vectors that take the steps in turn (independent chains, so that a
// single row keeps up with the weight streaming in), in the same order whatever the tile, so a
// row's products do not depend on its batch.
// - Up to kStreamRows rows, one weight row after the other meets every row of x, so that the
//   weight streams through the cache in order (four weight rows read side by side ran at half
//   the read bandwidth): a decode step of a few sequences is bound by that read.
// - Past it, a tile of kTileOuts weight rows meets the rows of x kTileRows at a time: a decode
//   step of tens of sequences is bound by the products (docs/benchmarks/cpu_kernels.md, "The
//   CPU dense kernel past 8 rows"). Where widening the weight's values costs more than the
//   products (int8), a larger tile of kPassOuts x kPassRows sums its kAcc vectors one after the
//   other, each in a pass over I of its own: the same sums, kAcc times fewer in registers, and
//   each widened value meets more rows.
#pragma once

#include <cstdint>

#include "simd_lanes.h"

namespace jvllm {

// The sums of a tile stay in registers, a quarter of kRegisters (AVX2's bfloat16 products of 8
// rows and of 2 x 4 tiles, which spilled, took 2-5x longer).
constexpr int kAcc = 2;                       // vectors each (row, output) pair sums in
constexpr int kStreamRows = 8;                // rows that meet one weight row at a time ...
constexpr int kStreamGroup = kRegisters / 4;  // ... this many at once
constexpr int kTileRows = 2;                  // past kStreamRows: rows of x ...
constexpr int kTileOuts = kRegisters / 8;     // ... against weight rows at a time
// The tiles in passes: AVX2's 4 x 3 ran int8 1.35x faster than its 2 x 2 tiles, AVX-512's 4 x 4
// 1.3x faster than 2 x 4 (of 2 x 4, 3 x 3, 5 x 2, 6 x 2; 4 x 6, 6 x 4, 8 x 3, 3 x 8, 5 x 5).
constexpr int kPassRows = 4;
constexpr int kPassOuts = kRegisters == 32 ? 4 : 3;

// The policy of operands stored as XT and WT (float, bfloat16 bits or int8) that a step loads
// a vector of each, widened to float32.
template <typename XT, typename WT>
struct Widened {
  using X = XT;
  using W = WT;
  static constexpr int kStep = kLanes;
  JVLLM_INLINE static vf32 load_x(const X* p) { return load_lanes(p); }
  JVLLM_INLINE static vf32 load_w(const W* p) { return load_lanes(p); }
  JVLLM_INLINE static vf32 add(vf32 acc, vf32 x, vf32 w) { return multiply_add(x, w, acc); }
};

// Adds the products of kRows rows of x with kOuts weight rows at k to acc[.][.][a].
template <typename D, int kRows, int kOuts, int kSums>
JVLLM_INLINE void add_products(vf32 (&acc)[kRows][kOuts][kSums], int a, const typename D::X* x,
                               const typename D::W* w, int64_t I, int64_t k) {
  decltype(D::load_w(w)) wk[kOuts];
  JVLLM_UNROLLED for (int o = 0; o < kOuts; ++o) wk[o] = D::load_w(w + o * I + k);
  JVLLM_UNROLLED for (int r = 0; r < kRows; ++r) {
    const auto xk = D::load_x(x + r * I + k);
    JVLLM_UNROLLED for (int o = 0; o < kOuts; ++o) acc[r][o][a] = D::add(acc[r][o][a], xk, wk[o]);
  }
}

// y[r * O + o] = x[r] . w[o] for r < kRows and o < kOuts; I a multiple of D::kStep.
template <typename D, int kRows, int kOuts>
inline void dense_tile(const typename D::X* x, const typename D::W* w, int64_t I, int64_t O,
                       float* y) {
  constexpr int kStep = D::kStep;
  vf32 acc[kRows][kOuts][kAcc];
  for (int r = 0; r < kRows; ++r) {
    for (int o = 0; o < kOuts; ++o) {
      for (int a = 0; a < kAcc; ++a) acc[r][o][a] = 0.f;
    }
  }
  int64_t k = 0;
  for (; k + kAcc * kStep <= I; k += kAcc * kStep) {
    JVLLM_UNROLLED for (int a = 0; a < kAcc; ++a) add_products<D>(acc, a, x, w, I, k + a * kStep);
  }
  for (; k < I; k += kStep) add_products<D>(acc, 0, x, w, I, k);
  for (int r = 0; r < kRows; ++r) {
    for (int o = 0; o < kOuts; ++o) {
      vf32 sum = acc[r][o][0];
      for (int a = 1; a < kAcc; ++a) sum += acc[r][o][a];
      y[r * O + o] = sum_lanes(sum);
    }
  }
}

// dense_tile's results, each of its kAcc sums in a pass over I of its own: the steps it takes
// in the same order, in one vector a pair.
template <typename D, int kRows, int kOuts>
inline void dense_tile_in_passes(const typename D::X* x, const typename D::W* w, int64_t I,
                                 int64_t O, float* y) {
  constexpr int kStep = D::kStep;
  const int64_t end = I / (kAcc * kStep) * (kAcc * kStep);  // past it, dense_tile's acc[0] only
  vf32 sums[kAcc][kRows][kOuts];
  JVLLM_UNROLLED for (int a = 0; a < kAcc; ++a) {
    vf32 acc[kRows][kOuts][1];
    JVLLM_UNROLLED for (int r = 0; r < kRows; ++r) {
      JVLLM_UNROLLED for (int o = 0; o < kOuts; ++o) acc[r][o][0] = 0.f;
    }
    for (int64_t k = a * kStep; k < end; k += kAcc * kStep) add_products<D>(acc, 0, x, w, I, k);
    if (a == 0) {
      for (int64_t k = end; k < I; k += kStep) add_products<D>(acc, 0, x, w, I, k);
    }
    JVLLM_UNROLLED for (int r = 0; r < kRows; ++r) {
      JVLLM_UNROLLED for (int o = 0; o < kOuts; ++o) sums[a][r][o] = acc[r][o][0];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int o = 0; o < kOuts; ++o) {
      vf32 sum = sums[0][r][o];
      for (int a = 1; a < kAcc; ++a) sum += sums[a][r][o];
      y[r * O + o] = sum_lanes(sum);
    }
  }
}

// Up to kStreamRows rows against weight rows [o_first, o_last), one weight row at a time.
template <typename D, int kRows>
void stream_rows(int64_t o_first, int64_t o_last, const typename D::X* x,
                 const typename D::W* w, int64_t I, int64_t O, float* y) {
  static_assert(kRows <= 2 * kStreamGroup);
  constexpr int kFirst = kRows < kStreamGroup ? kRows : kStreamGroup;
  for (int64_t o = o_first; o < o_last; ++o) {
    dense_tile<D, kFirst, 1>(x, w + o * I, I, O, y + o);
    if constexpr (kRows > kFirst) {  // the weight row again, from the cache
      dense_tile<D, kRows - kFirst, 1>(x + kFirst * I, w + o * I, I, O, y + kFirst * O + o);
    }
  }
}

// Up to kStreamRows rows R of x against weight rows [o_first, o_last).
template <typename D>
void stream_range(int64_t R, int64_t o_first, int64_t o_last, const typename D::X* x,
                  const typename D::W* w, int64_t I, int64_t O, float* y) {
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
}

// All R rows of x against the kOuts weight rows at w, kTileRows rows at a time (kInPasses:
// kPassRows, in passes).
template <typename D, int kOuts, bool kInPasses>
void tile_rows(int64_t R, const typename D::X* x, const typename D::W* w, int64_t I, int64_t O,
               float* y) {
  constexpr int kRows = kInPasses ? kPassRows : kTileRows;
  int64_t r = 0;
  for (; r + kRows <= R; r += kRows) {
    if constexpr (kInPasses) {
      dense_tile_in_passes<D, kRows, kOuts>(x + r * I, w, I, O, y + r * O);
    } else {
      dense_tile<D, kRows, kOuts>(x + r * I, w, I, O, y + r * O);
    }
  }
  for (; r < R; ++r) dense_tile<D, 1, kOuts>(x + r * I, w, I, O, y + r * O);
}

// The R rows of x against weight rows [o_first, o_last): streamed up to kStreamRows rows, else
// in tiles (kInPasses: tiles in passes).
template <typename D, bool kInPasses = false>
void dense_range(int64_t R, int64_t o_first, int64_t o_last, const typename D::X* x,
                 const typename D::W* w, int64_t I, int64_t O, float* y) {
  if (R <= kStreamRows) return stream_range<D>(R, o_first, o_last, x, w, I, O, y);
  constexpr int kOuts = kInPasses ? kPassOuts : kTileOuts;
  int64_t o = o_first;
  for (; o + kOuts <= o_last; o += kOuts) {
    tile_rows<D, kOuts, kInPasses>(R, x, w + o * I, I, O, y + o);
  }
  for (; o < o_last; ++o) tile_rows<D, 1, kInPasses>(R, x, w + o * I, I, O, y + o);
}

}  // namespace jvllm
