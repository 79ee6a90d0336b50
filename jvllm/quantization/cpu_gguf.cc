// x @ W.T for a weight W [O, I] kept as GGUF blocks, on XLA:CPU through the XLA FFI
// (cpu_gguf.py builds it).
//
// Each block of a row of W is dequantized once into float32, with gguf.quants' operations in
// its order (compiled with -ffp-contract=off, so a product and a sum never fuse), which gives
// the values gguf's dequantize gives bit for bit; in a bfloat16 model they are then rounded to
// bfloat16 (to nearest even) as the model's float weight would be. The block is multiplied into
// the R rows of x (already in the model dtype, as float32) and summed in float32, with fused
// multiply-adds where the CPU has them. The fields of the blocks come in as separate arrays
// [L, O, nb, ...] with a layer index, so that a layer of the scan's stacked weights is read
// where it lies; output rows are split among XLA's intra-op threads. For more rows than
// gguf_dense takes, gguf_dequantize writes the layer's values out for XLA's matmul.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 32;
constexpr int kPrefetchBlocks = 64;  // how far ahead each field's stream is fetched

inline float bits_to_float(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// IEEE half -> float, exactly: the F16C instruction where there is one, else integer
// arithmetic only (XLA's threads may treat denormal floats as zero; F16C's half inputs are not).
inline float half_to_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000 | (mantissa << 13));
  if (exponent == 0) {
    const float x = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -x : x;
  }
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
#endif
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return half_to_float(h);
}

// n float16 values at src -> float32 at dst[j * stride + offset]; eight at a time with F16C.
inline void halves_to_floats(const uint8_t* src, int64_t n, int offset, int stride,
                             float* dst) {
  int64_t j = 0;
#ifdef __F16C__
  alignas(32) float eight[8];
  for (; j + 8 <= n; j += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * j));
    _mm256_store_ps(eight, _mm256_cvtph_ps(h));
    for (int k = 0; k < 8; ++k) dst[(j + k) * stride + offset] = eight[k];
  }
#endif
  for (; j < n; ++j) dst[j * stride + offset] = half_at(src + 2 * j);
}

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

template <typename V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// a * b + c, rounded once where the CPU has FMA: the sums of products, whose order is the
// kernel's own (the values' dequantization, by contrast, never fuses; see the top).
inline f32v multiply_add(f32v a, f32v b, f32v c) {
#if defined(__AVX512F__)
  return (f32v)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX__) && defined(__FMA__)
  return (f32v)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// N bytes at p as 32-bit lanes, where the bit work happens (x86 has no byte shifts). GCC 12
// widens a vector of bytes one lane at a time, so x86 gets its zero-extending load.
inline i32v widen(const uint8_t* p) {
#if defined(__AVX512F__)
  return (i32v)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (i32v)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  i32v q;
  for (int l = 0; l < N; ++l) q[l] = p[l];
  return q;
#endif
}

inline f32v to_f32(i32v q) { return __builtin_convertvector(q, f32v); }

// Each format: its block size, its number of fields, how many of them (kHalves, leading) are
// one float16 scale per block, and how one block becomes kBlock / N vectors of values from
// its fields (pointers to the block's bytes in each field array, in gguf_blocks.py's order)
// and its kHalves scales s, already in float32 (dense_rows converts a row's at once).
struct Q8_0 {
  static constexpr int kFields = 2, kHalves = 1;
  static constexpr int kBlock = 32;
  static void dequantize(const uint8_t* const* f, const float* s, f32v* w) {
    const float d = s[0];
    // Signed bytes as unsigned ones offset by 128: GCC converts those a vector at a time.
    for (int v = 0; v < 32 / N; ++v) {
      w[v] = (to_f32(widen(f[1] + N * v) ^ 0x80) - 128.f) * d;
    }
  }
};

struct Q4_0 {
  static constexpr int kFields = 2, kHalves = 1;
  static constexpr int kBlock = 32;
  static void dequantize(const uint8_t* const* f, const float* s, f32v* w) {
    const float d = s[0];
    for (int v = 0; v < 16 / N; ++v) {
      const i32v q = widen(f[1] + N * v);  // byte j holds values j (low nibble) and j + 16
      w[v] = d * (to_f32(q & 15) - 8.f);
      w[16 / N + v] = d * (to_f32(q >> 4) - 8.f);
    }
  }
};

struct Q4_1 {
  static constexpr int kFields = 3, kHalves = 2;
  static constexpr int kBlock = 32;
  static void dequantize(const uint8_t* const* f, const float* s, f32v* w) {
    const float d = s[0], m = s[1];
    for (int v = 0; v < 16 / N; ++v) {
      const i32v q = widen(f[2] + N * v);
      w[v] = d * to_f32(q & 15) + m;
      w[16 / N + v] = d * to_f32(q >> 4) + m;
    }
  }
};

struct Q4_K {
  static constexpr int kFields = 4, kHalves = 2;
  static constexpr int kBlock = 256;
  static void dequantize(const uint8_t* const* f, const float* halves, f32v* w) {
    const float d = halves[0], dmin = halves[1];
    const uint8_t *s = f[2], *qs = f[3];
    // Eight 6-bit (scale, min) pairs: the first four in the low bits of bytes 0-7, the last
    // four split over bytes 8-11 and the top bits of bytes 0-7.
    float scale[8], offset[8];
    for (int j = 0; j < 4; ++j) {
      scale[j] = d * static_cast<float>(s[j] & 0x3F);
      offset[j] = dmin * static_cast<float>(s[j + 4] & 0x3F);
      scale[j + 4] = d * static_cast<float>((s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30));
      offset[j + 4] = dmin * static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
    }
    // 32 bytes per pair of sub-blocks: the low nibbles the first, the high the second.
    for (int pair = 0; pair < 4; ++pair) {
      for (int v = 0; v < 32 / N; ++v) {
        const i32v q = widen(qs + pair * 32 + N * v);
        w[(2 * pair) * (32 / N) + v] = scale[2 * pair] * to_f32(q & 15) - offset[2 * pair];
        w[(2 * pair + 1) * (32 / N) + v] =
            scale[2 * pair + 1] * to_f32(q >> 4) - offset[2 * pair + 1];
      }
    }
  }
};

struct Q6_K {
  static constexpr int kFields = 4, kHalves = 0;
  static constexpr int kBlock = 256;
  static void dequantize(const uint8_t* const* f, const float*, f32v* w) {
    const uint8_t *ql = f[0], *qh = f[1];
    const int8_t* scales = reinterpret_cast<const int8_t*>(f[2]);
    const float d = half_at(f[3]);
    float scale[16];  // one per 16 values
    for (int j = 0; j < 16; ++j) scale[j] = d * static_cast<float>(scales[j]);
    // Two halves of 128 values; in each, rows k = 0..3 of 32: the low 4 bits from the low
    // (k < 2) or high nibbles of 32 bytes of ql, the high 2 bits from bits 2k of qh's 32.
    for (int half = 0; half < 2; ++half) {
      for (int v = 0; v < 32 / N; ++v) {
        const i32v low[2] = {widen(ql + half * 64 + N * v), widen(ql + half * 64 + 32 + N * v)};
        const i32v high = widen(qh + half * 32 + N * v);
        for (int k = 0; k < 4; ++k) {
          const i32v q = ((low[k % 2] >> ((k / 2) * 4)) & 15) | (((high >> (2 * k)) & 3) << 4);
          const int at = half * 128 + k * 32 + N * v;  // this vector's first value
          w[at / N] = scale[at / 16] * (to_f32(q) - 32.f);
        }
      }
    }
  }
};

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

// Each lane rounded to the nearest bfloat16 (ties to even), in integer vector arithmetic.
inline f32v round_to_bfloat16(f32v w) {
  typedef uint32_t u32v __attribute__((vector_size(4 * N)));
  const u32v bits = (u32v)w;
  const u32v rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
  return (f32v)((bits & 0x7FFFFFFF) > 0x7F800000 ? bits : rounded);  // NaN stays
}

// For each block b of row o of W (fields at one layer), visit(b, w) with the block's values
// w[kBlock / N] (bfloat16-rounded where kBF16). `halves` holds a row's scales. Always inlined:
// otherwise the values went through memory (one row's product 1.5x slower).
template <typename F, bool kBF16, typename Visit>
__attribute__((always_inline)) inline void row_blocks(int64_t o, int64_t nb,
                                                      const uint8_t* const* fields,
                                                      const int64_t* field_bytes,
                                                      std::vector<float>& halves, Visit visit) {
  constexpr int V = F::kBlock / N;  // vectors per block
  f32v w[V];
  const uint8_t* block[F::kFields];
  for (int i = 0; i < F::kFields; ++i) block[i] = fields[i] + o * nb * field_bytes[i];
  for (int i = 0; i < F::kHalves; ++i) {
    halves_to_floats(block[i], nb, i, F::kHalves, halves.data());
  }
  for (int64_t b = 0; b < nb; ++b) {
    F::dequantize(block, halves.data() + b * F::kHalves, w);
    for (int i = 0; i < F::kFields; ++i) {
      __builtin_prefetch(block[i] + kPrefetchBlocks * field_bytes[i]);
      block[i] += field_bytes[i];
    }
    if (kBF16) {
      for (int v = 0; v < V; ++v) w[v] = round_to_bfloat16(w[v]);
    }
    visit(b, w);
  }
}

// Output rows [o_first, o_last) of y [R, O] = x [R, I] @ W.T, W's fields at one layer. kRows
// fixes R at compile time (0: R at run time), so that one row's sums stay in registers.
template <typename F, bool kBF16, int kRows>
void dense_rows(int64_t o_first, int64_t o_last, const float* x, int64_t R, int64_t I,
                int64_t O, const uint8_t* const* fields, const int64_t* field_bytes, float* y) {
  constexpr int V = F::kBlock / N;
  if (kRows > 0) R = kRows;
  const int64_t nb = I / F::kBlock;
  f32v acc[kRows > 0 ? kRows : kMaxRows];
  std::vector<float> halves(F::kHalves * nb + 1);  // [nb, kHalves]
  for (int64_t o = o_first; o < o_last; ++o) {
    for (int64_t r = 0; r < R; ++r) acc[r] = f32v{};
    row_blocks<F, kBF16>(o, nb, fields, field_bytes, halves, [&](int64_t b, const f32v* w) {
      for (int64_t r = 0; r < R; ++r) {
        const float* xb = x + r * I + b * F::kBlock;
        for (int v = 0; v < V; ++v) acc[r] = multiply_add(w[v], load<f32v>(xb + N * v), acc[r]);
      }
    });
    for (int64_t r = 0; r < R; ++r) y[r * O + o] = sum_lanes(acc[r]);
  }
}

// Rows [o_first, o_last) of W [O, I] at one layer, dequantized into out: float32, or the
// bfloat16 values' 16 bits.
template <typename F, bool kBF16>
void dequantize_rows(int64_t o_first, int64_t o_last, int64_t I, const uint8_t* const* fields,
                     const int64_t* field_bytes, void* out) {
  constexpr int V = F::kBlock / N;
  const int64_t nb = I / F::kBlock;
  std::vector<float> halves(F::kHalves * nb + 1);
  for (int64_t o = o_first; o < o_last; ++o) {
    row_blocks<F, kBF16>(o, nb, fields, field_bytes, halves, [&](int64_t b, const f32v* w) {
      const int64_t first = o * I + b * F::kBlock;
      if (!kBF16) {
        std::memcpy(static_cast<float*>(out) + first, w, sizeof(f32v) * V);
        return;
      }
      uint16_t* dst = static_cast<uint16_t*>(out) + first;
      for (int v = 0; v < V; ++v) {
        typedef uint32_t u32v __attribute__((vector_size(4 * N)));
        const u32v bits = (u32v)w[v] >> 16;  // exact: already rounded
#if defined(__AVX512F__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + N * v),
                            _mm512_cvtepi32_epi16((__m512i)bits));
#else
        for (int l = 0; l < N; ++l) dst[N * v + l] = static_cast<uint16_t>(bits[l]);
#endif
      }
    });
  }
}

// The fields' arrays at the layer, and one block's bytes of each; an error where the arguments
// do not describe W [O, I] of the format.
template <typename F>
ffi::Error layer_fields(ffi::RemainingArgs& fields, int64_t at, int64_t O, int64_t I,
                        const uint8_t** data, int64_t* field_bytes) {
  if (fields.size() != F::kFields || I % F::kBlock != 0) {
    return ffi::Error::InvalidArgument("gguf: the format's fields, whole blocks");
  }
  const int64_t num_blocks = O * (I / F::kBlock);
  for (int i = 0; i < F::kFields; ++i) {
    auto field = fields.get<ffi::AnyBuffer>(i);
    if (field.has_error()) return field.error();
    if (field->dimensions().size() == 0 || at < 0 || at >= field->dimensions()[0]) {
      return ffi::Error::InvalidArgument("gguf: fields [L, O, nb, ...], layer in [0, L)");
    }
    const int64_t layer_bytes = static_cast<int64_t>(field->size_bytes()) / field->dimensions()[0];
    field_bytes[i] = layer_bytes / num_blocks;
    data[i] = static_cast<const uint8_t*>(field->untyped_data()) + at * layer_bytes;
  }
  return ffi::Error::Success();
}

template <typename F, bool kBF16>
ffi::Error gguf_dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                      ffi::RemainingArgs fields, ffi::ResultBuffer<ffi::F32> y) {
  auto x_dims = x.dimensions(), y_dims = y->dimensions();
  if (x_dims.size() != 2 || y_dims.size() != 2 || x_dims[0] > kMaxRows) {
    return ffi::Error::InvalidArgument("gguf_dense: x [R <= 32, I], y [R, O]");
  }
  const int64_t R = x_dims[0], I = x_dims[1], O = y_dims[1];
  const uint8_t* data[F::kFields];
  int64_t field_bytes[F::kFields];
  ffi::Error error = layer_fields<F>(fields, layer.typed_data()[0], O, I, data, field_bytes);
  if (error.failure()) return error;
  float* out = y->typed_data();
  jvllm::parallel_ranges(pool, O, 8, O / 16, [&](int64_t first, int64_t last) {
    if (R == 1) {
      dense_rows<F, kBF16, 1>(first, last, x.typed_data(), R, I, O, data, field_bytes, out);
    } else {
      dense_rows<F, kBF16, 0>(first, last, x.typed_data(), R, I, O, data, field_bytes, out);
    }
  });
  return ffi::Error::Success();
}

// W [O, I] at the layer, dequantized for XLA's matmul of more rows than gguf_dense takes: XLA's
// own dequantization of a Q4_1 [3072, 576] layer took 1.5 ms (4.4 in bfloat16) against the
// 64-row matmul's 1.2.
template <typename F, bool kBF16>
ffi::Error gguf_dequantize(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer,
                           ffi::RemainingArgs fields,
                           ffi::Result<ffi::Buffer<kBF16 ? ffi::BF16 : ffi::F32>> w) {
  auto w_dims = w->dimensions();
  if (w_dims.size() != 2) return ffi::Error::InvalidArgument("gguf_dequantize: w [O, I]");
  const int64_t O = w_dims[0], I = w_dims[1];
  const uint8_t* data[F::kFields];
  int64_t field_bytes[F::kFields];
  ffi::Error error = layer_fields<F>(fields, layer.typed_data()[0], O, I, data, field_bytes);
  if (error.failure()) return error;
  void* out = w->untyped_data();
  jvllm::parallel_ranges(pool, O, 8, O, [&](int64_t first, int64_t last) {
    dequantize_rows<F, kBF16>(first, last, I, data, field_bytes, out);
  });
  return ffi::Error::Success();
}

}  // namespace

#define GGUF_HANDLERS(name, format, bf16, type)                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(GGUFDense##name, (gguf_dense<format, bf16>),  \
                                ffi::Ffi::Bind()                             \
                                    .Ctx<ffi::ThreadPool>()                  \
                                    .Arg<ffi::Buffer<ffi::F32>>()            \
                                    .Arg<ffi::Buffer<ffi::S32>>()            \
                                    .RemainingArgs()                         \
                                    .Ret<ffi::Buffer<ffi::F32>>());          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(GGUFDequantize##name,                        \
                                (gguf_dequantize<format, bf16>),             \
                                ffi::Ffi::Bind()                             \
                                    .Ctx<ffi::ThreadPool>()                  \
                                    .Arg<ffi::Buffer<ffi::S32>>()            \
                                    .RemainingArgs()                         \
                                    .Ret<ffi::Buffer<ffi::type>>());

GGUF_HANDLERS(Q8_0F32, Q8_0, false, F32)
GGUF_HANDLERS(Q8_0BF16, Q8_0, true, BF16)
GGUF_HANDLERS(Q4_0F32, Q4_0, false, F32)
GGUF_HANDLERS(Q4_0BF16, Q4_0, true, BF16)
GGUF_HANDLERS(Q4_1F32, Q4_1, false, F32)
GGUF_HANDLERS(Q4_1BF16, Q4_1, true, BF16)
GGUF_HANDLERS(Q4_KF32, Q4_K, false, F32)
GGUF_HANDLERS(Q4_KBF16, Q4_K, true, BF16)
GGUF_HANDLERS(Q6_KF32, Q6_K, false, F32)
GGUF_HANDLERS(Q6_KBF16, Q6_K, true, BF16)
