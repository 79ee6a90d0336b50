// (x @ V.T) * s for int8 weight values V [O, I] with a scale s per row and bfloat16 rows
// x [R, I], on XLA:CPU through the XLA FFI (quantization/cpu_int8.py builds it), and V * s
// converted to bfloat16 for XLA's matmul of more rows.
//
// The values are exact in bfloat16 and in float32, so the products are those of XLA's matmul
// of x with the values converted to bfloat16, summed in float32 in another order. The values
// come in stacked [L, O, I] with a layer index, so that a layer of the scan's weights is read
// where it lies; weight rows are split among XLA's intra-op threads.
// - With AVX-512 BF16, a panel of kPanel weight rows is converted once into bfloat16, where the
//   cache keeps it, then meets the rows of x in blocks of kBlockRows with its dot products (32
//   products an instruction), each (row, output) pair summing in one vector.
// - Elsewhere, over the portable SIMD layer, dense_tile.h's loop widens the values and x's
//   bfloat16 to float32 in registers and sums their fused multiply-adds.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dense_tile.h"
#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kStep = 32;      // cpu_int8.py's multiple of I
constexpr int kPanel = 4;      // cpu_int8.py's multiple of O
constexpr int kMaxRows = 128;  // past it XLA's matmul of the converted values is faster

#if defined(__AVX512BF16__)
// 4 x 6: 24 sums in registers; of 8 x 3, 2 x 12, 4 x 5 and 3 x 8 none was faster on SmolLM2's
// shapes at 64 rows.
constexpr int kBlockRows = 6;  // rows of x that meet a panel at once

// 32 int8 values as float32, in two vectors of 16.
inline void int8_to_floats(const int8_t* v, __m512* a, __m512* b) {
  const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16));
  *a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(low));
  *b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(high));
}

// 32 int8 values -> 32 bfloat16 (exact: |v| <= 128 has at most 8 significant bits).
inline __m512bh int8_to_bfloat16(const int8_t* v) {
  __m512 a, b;
  int8_to_floats(v, &a, &b);
  return _mm512_cvtne2ps_pbh(b, a);  // a's values first
}

// 32 int8 values times `scale` -> 32 bfloat16, rounded to nearest even.
inline __m512bh scaled_to_bfloat16(const int8_t* v, float scale) {
  __m512 a, b;
  int8_to_floats(v, &a, &b);
  const __m512 s = _mm512_set1_ps(scale);
  return _mm512_cvtne2ps_pbh(_mm512_mul_ps(b, s), _mm512_mul_ps(a, s));
}

inline __m512bh load_bfloat16_dots(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// y[r, o] for the kRows rows of x from `x` and the panel's kPanel converted weight rows, each
// output times its row's scale.
template <int kRows>
void block_rows(const uint16_t* x, const uint16_t* panel, const float* scale, int64_t I,
                int64_t O, float* y) {
  __m512 acc[kRows][kPanel];
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kPanel; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < I; k += kStep) {
    __m512bh w[kPanel];
    for (int j = 0; j < kPanel; ++j) w[j] = load_bfloat16_dots(panel + j * I + k);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh xr = load_bfloat16_dots(x + r * I + k);
      for (int j = 0; j < kPanel; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xr, w[j]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kPanel; ++j) y[r * O + j] = _mm512_reduce_add_ps(acc[r][j]) * scale[j];
  }
}

// All R rows of x, in blocks, against one converted panel.
void panel_rows(int64_t R, const uint16_t* x, const uint16_t* panel, const float* scale,
                int64_t I, int64_t O, float* y) {
  int64_t r = 0;
  for (; r + kBlockRows <= R; r += kBlockRows) {
    block_rows<kBlockRows>(x + r * I, panel, scale, I, O, y + r * O);
  }
  switch (R - r) {  // the rows left over, fewer than a block
    case 5: block_rows<5>(x + r * I, panel, scale, I, O, y + r * O); break;
    case 4: block_rows<4>(x + r * I, panel, scale, I, O, y + r * O); break;
    case 3: block_rows<3>(x + r * I, panel, scale, I, O, y + r * O); break;
    case 2: block_rows<2>(x + r * I, panel, scale, I, O, y + r * O); break;
    case 1: block_rows<1>(x + r * I, panel, scale, I, O, y + r * O); break;
  }
}

// All R rows of x against panels [p_first, p_last) of the weight.
void dense_panels(int64_t p_first, int64_t p_last, const uint16_t* x, const int8_t* values,
                  const float* scale, int64_t R, int64_t I, int64_t O, float* y) {
  std::vector<uint16_t> panel(kPanel * I);
  for (int64_t p = p_first; p < p_last; ++p) {
    const int64_t o = p * kPanel;
    for (int j = 0; j < kPanel; ++j) {
      for (int64_t k = 0; k < I; k += kStep) {
        const __m512bh w = int8_to_bfloat16(values + (o + j) * I + k);
        _mm512_storeu_si512(reinterpret_cast<void*>(panel.data() + j * I + k), (__m512i)w);
      }
    }
    panel_rows(R, x, panel.data(), scale + o, I, O, y + o);
  }
}

// The dot products read x's bfloat16 as it is: nothing to widen.
const float* widened_rows(int64_t, int64_t, const uint16_t*) { return nullptr; }

// The R rows of x against weight rows [o_first, o_last), a multiple of kPanel apart.
void dense_rows(int64_t R, int64_t o_first, int64_t o_last, const uint16_t* x, const float*,
                const int8_t* values, const float* scale, int64_t I, int64_t O, float* y) {
  dense_panels(o_first / kPanel, o_last / kPanel, x, values, scale, R, I, O, y);
}

// kStep int8 values times `scale` -> kStep bfloat16 at dst, rounded to nearest even.
inline void store_scaled(const int8_t* v, float scale, uint16_t* dst) {
  _mm512_storeu_si512(reinterpret_cast<void*>(dst), (__m512i)scaled_to_bfloat16(v, scale));
}
#else
// Rows of x times int8 values widened to float32 in registers: up to kStreamRows rows, x
// widened to float32 once a call, before the threads split the weight (AVX2's one-row products
// 1.2x faster), into a buffer the calling thread keeps (a fresh one a call would fault its pages
// in each step); past them, where the tiles read x again for each few weight rows, its bfloat16
// widened in registers, half the bytes to read (a float32 copy of 64 rows outgrew the L1 cache:
// AVX2's tiles 1.2x slower), in dense_tile.h's tiles in passes, where each widened value meets
// more rows (widening, not the products, bounds them). The same sums either way.
using Int8 = jvllm::Widened<float, int8_t>;
using Int8Rows = jvllm::Widened<uint16_t, int8_t>;

// x [R, I] widened to float32 for dense_rows, or nullptr past kStreamRows rows.
const float* widened_rows(int64_t R, int64_t I, const uint16_t* x) {
  if (R > jvllm::kStreamRows) return nullptr;
  thread_local std::vector<float> rows;
  rows.resize(R * I);
  for (int64_t k = 0; k < R * I; k += kLanes) {
    load_lanes(x + k).copy_to(rows.data() + k, stdx::element_aligned);
  }
  return rows.data();
}

// widened: widened_rows(R, I, x).
void dense_rows(int64_t R, int64_t o_first, int64_t o_last, const uint16_t* x,
                const float* widened, const int8_t* values, const float* scale, int64_t I,
                int64_t O, float* y) {
  if (widened != nullptr) {
    jvllm::dense_range<Int8>(R, o_first, o_last, widened, values, I, O, y);
  } else {
    jvllm::dense_range<Int8Rows, /*kInPasses=*/true>(R, o_first, o_last, x, values, I, O, y);
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t o = o_first; o < o_last; ++o) y[r * O + o] *= scale[o];
  }
}

inline void store_scaled(const int8_t* v, float scale, uint16_t* dst) {
  static_assert(kStep % kLanes == 0);
  for (int i = 0; i < kStep; i += kLanes) store_bfloat16(load_lanes(v + i) * scale, dst + i);
}
#endif

// Layer `at` of values [L, O, I] and of scales [L, O]; an error where they do not fit together
// or the kernel's shapes.
ffi::Error layer_values(ffi::Buffer<ffi::S8>& values, ffi::Buffer<ffi::F32>& scales, int64_t at,
                        const int8_t** v, const float** scale) {
  auto dims = values.dimensions();
  if (dims.size() != 3 || scales.element_count() != dims[0] * dims[1]) {
    return ffi::Error::InvalidArgument("int8: values [L, O, I], scales [L, O]");
  }
  if (dims[2] % kStep != 0 || dims[1] % kPanel != 0 || at < 0 || at >= dims[0]) {
    return ffi::Error::InvalidArgument("int8: I a multiple of 32, O of 4, layer in [0, L)");
  }
  *v = values.typed_data() + at * dims[1] * dims[2];
  *scale = scales.typed_data() + at * dims[1];
  return ffi::Error::Success();
}

ffi::Error int8_dense(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> layer,
                      ffi::Buffer<ffi::S8> values, ffi::Buffer<ffi::F32> scales,
                      ffi::ResultBuffer<ffi::F32> y) {
  const int8_t* v;
  const float* scale;
  ffi::Error error = layer_values(values, scales, layer.typed_data()[0], &v, &scale);
  if (error.failure()) return error;
  auto x_dims = x.dimensions();
  const int64_t O = values.dimensions()[1], I = values.dimensions()[2];
  if (x_dims.size() != 2 || x_dims[0] > kMaxRows || x_dims[1] != I) {
    return ffi::Error::InvalidArgument("int8_dense: x [R <= 128, I]");
  }
  const int64_t R = x_dims[0];
  const auto* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  float* out = y->typed_data();
  const int64_t num_panels = O / kPanel;
  const float* widened = widened_rows(R, I, xs);
  jvllm::parallel_ranges(pool, num_panels, 8, num_panels, [&](int64_t first, int64_t last) {
    dense_rows(R, first * kPanel, last * kPanel, xs, widened, v, scale, I, O, out);
  });
  return ffi::Error::Success();
}

// values[layer] times their rows' scales as bfloat16 [O, I], for XLA's matmul of more rows than
// the kernel takes: scaling its float32 result instead took a pass of its own over it (int8
// prefills 1.3x slower than bfloat16).
ffi::Error convert_layer(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S8> values, ffi::Buffer<ffi::F32> scales,
                         ffi::ResultBuffer<ffi::BF16> out) {
  const int8_t* v;
  const float* scale;
  ffi::Error error = layer_values(values, scales, layer.typed_data()[0], &v, &scale);
  if (error.failure()) return error;
  const int64_t O = values.dimensions()[1], I = values.dimensions()[2];
  if (out->element_count() != O * I) return ffi::Error::InvalidArgument("int8: out [O, I]");
  auto* w = reinterpret_cast<uint16_t*>(out->typed_data());
  jvllm::parallel_ranges(pool, O, 8, O, [&](int64_t first, int64_t last) {
    for (int64_t k = first * I; k < last * I; k += kStep) store_scaled(v + k, scale[k / I], w + k);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8DenseBF16, int8_dense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8ToBF16, convert_layer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
