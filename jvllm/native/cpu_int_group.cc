// x @ W.T for a weight W [O, I] of 4- or 8-bit integers with a scale (and a zero point) per
// group of input columns, packed as quantization/int_weight.py lays it out, or of float8 e4m3
// values with a scale per block of rows and columns (quantization/fp8_weight.py), on XLA:CPU
// through the XLA FFI (quantization/cpu_int_group.py builds it).
//
// Value i of row o is w = (q - z) * s made as int_weight's dequantize makes it, bit for bit:
// q - z is exact in float32 and in every scale dtype (for int_weight's zero points, in q's
// range), and a product of float16 or bfloat16 values is exact in float32, so the float32
// product rounded once to the scale dtype is that dtype's product (float16 subnormals kept, as
// float16 arithmetic keeps them, where int_weight's reduce_precision flushes them to zero); it
// is then rounded to the model dtype (compiled with -ffp-contract=off: no product and sum
// fuse). An e4m3 value is exact in float32 (simd_lanes.h's load_e4m3), so its value times
// the scale is made the same way, as fp8_weight's dequantize makes it. A 4-bit group has 16
// values only, so each output row's groups become tables of 16 values, and a run of 32 columns
// (16 bytes) is looked up by nibble: one permute for 16 values with AVX-512, as few operations
// as scaling a group's sum of x times its integers would take, and every value exact, in a
// float32 model as in a bfloat16 one. 8-bit integer and e4m3 values are made vector by vector.
//
// The values meet up to kMaxRows rows of x (in the model dtype), summing in float32: fused
// multiply-adds, or in a bfloat16 model bfloat16 dot products where the CPU has them (the values
// are bfloat16, so each product is exact). A tile of weight rows by rows of x sums in registers,
// group by group, each (row, output) pair in the same chains whatever the tile, so a row's
// products do not depend on its batch. The layer's arrays are read where they lie in the stack
// [L, ...]; output rows are split among XLA's intra-op threads. For more rows,
// IntGroupDequantize writes the layer's values out for XLA's matmul.
//
// Written over the portable SIMD layer (simd_lanes.h: SSE, AVX2, AVX-512 and NEON from this
// source); the 4-bit tables' permutes, F16C's and AVX-512 BF16's conversions, AVX-512's masked
// loads of a row's scales and its bfloat16 dot products stay intrinsics beside their portable
// lines (docs/benchmarks/cpu_kernels.md).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "parallel_for.h"
#include "simd_lanes.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 32;  // cpu_int_group.py's MAX_ROWS
constexpr int kRun = 32;      // columns of a 4-bit run (int_weight.py's NIBBLE_RUN)
// How far ahead of the weight row being read a row's bytes and scales are fetched (one-row
// products of W [576, 1536] took 2.6x longer without it, of W [1536, 576] 1.15x).
constexpr int kRowsAhead = 8;

constexpr int V = kRun / N;  // vectors of a run
// A tile of kOuts weight rows by kRows rows of x sums in registers (kOuts * kRows * V vectors,
// or with bfloat16 dot products kOuts * kRows * 2). Past kRows rows of x, kTile weight rows
// meet each group of them in turn.
constexpr int kOuts = N == 16 ? 2 : 1, kRows = N == 16 ? 4 : 2, kTile = 8;

// Whether a bfloat16 model's values meet x in vdpbf16ps (AVX-512 BF16): 32 products an
// instruction where fused multiply-adds take 16.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JVLLM_BF16_DOTS 1
#endif

inline float bfloat16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  return load<float>(&bits);
}

// Each lane rounded to the nearest bfloat16 (ties to even), NaN kept. With AVX-512 BF16 in
// three instructions rather than eight, which flush values below 2^-126 to zero (a product of
// a scale that small: no checkpoint has one).
JVLLM_INLINE vf32 round_to_bfloat16(vf32 w) {
#if defined(__AVX512BF16__)
  const __m256i bf16 = (__m256i)_mm512_cvtneps_pbh(static_cast<__m512>(w));
  return vf32(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)));
#else
  return round_bits_to_bfloat16(w);
#endif
}

// IEEE float16, converted to and from float32 by the hardware: GCC 12's C++ has _Float16 on x86
// only, ARM's __fp16.
#if defined(__aarch64__)
using Half = __fp16;
#else
using Half = _Float16;
#endif

// Each lane rounded to the nearest float16 (ties to even), as float32.
JVLLM_INLINE vf32 round_to_half(vf32 w) {
#if defined(__AVX512F__)
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return vf32(_mm512_cvtph_ps(_mm512_cvtps_ph(static_cast<__m512>(w), kNearest)));
#elif defined(__AVX__) && defined(__F16C__)
  const __m128i halves = _mm256_cvtps_ph(static_cast<__m256>(w), _MM_FROUND_TO_NEAREST_INT);
  return vf32(_mm256_cvtph_ps(halves));
#else
  return vf32([w](auto l) { return static_cast<float>(static_cast<Half>(w[l])); });
#endif
}

template <bool kBF16>
constexpr bool bf16_dots() {
#ifdef JVLLM_BF16_DOTS
  return kBF16;
#else
  return false;
#endif
}

// The scale dtypes int_weight.py allows, each as its FFI type.
enum class Scale { kF16, kBF16, kF32 };

template <Scale S>
inline float scale_at(const uint8_t* scales, int64_t i) {
  if constexpr (S == Scale::kF32) return load<float>(scales + 4 * i);
  const uint16_t h = load<uint16_t>(scales + 2 * i);
  if constexpr (S == Scale::kBF16) return bfloat16_to_float(h);
  return static_cast<float>(load<Half>(&h));
}

// Integers less their zero point d (exact in float32) times scale s, rounded to the scale dtype.
template <Scale S>
inline vf32 scaled(vf32 d, float s) {
  const vf32 w = d * s;
  if constexpr (S == Scale::kF16) return round_to_half(w);
  if constexpr (S == Scale::kBF16) return round_to_bfloat16(w);
  return w;
}

// Their values in the model dtype (bfloat16 where kBF16), as int_weight computes them.
template <Scale S, bool kBF16>
inline vf32 make_values(vf32 d, float s) {
  const vf32 w = scaled<S>(d, s);
  return kBF16 && S != Scale::kBF16 ? round_to_bfloat16(w) : w;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define JVLLM_MASKED_LOADS 1
#endif

// n scales at src (of dtype S) as float32 at dst, which has room for whole vectors; 16 at a
// time with AVX-512.
template <Scale S>
inline void scales_to_floats(const uint8_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#ifdef JVLLM_MASKED_LOADS
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1;
    __m512 s;
    if constexpr (S == Scale::kF32) {
      s = _mm512_maskz_loadu_ps(m, src + 4 * i);
    } else {
      const __m256i h = _mm256_maskz_loadu_epi16(m, src + 2 * i);
      s = S == Scale::kF16 ? _mm512_cvtph_ps(h)
                           : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    _mm512_storeu_ps(dst + i, s);
  }
#endif
  for (; i < n; ++i) dst[i] = scale_at<S>(src, i);
}

// n zero points at src as float32 at dst, which has room for whole vectors.
inline void zeros_to_floats(const int16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#ifdef JVLLM_MASKED_LOADS
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1;
    const __m256i z = _mm256_maskz_loadu_epi16(m, src + i);
    _mm512_storeu_ps(dst + i, _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(z)));
  }
#endif
  for (; i < n; ++i) dst[i] = src[i];
}

// How W's bytes hold its values: packed integers of 4 or 8 bits, or float8 e4m3 values.
enum class Format { kInt4, kInt8, kFP8 };

// W's arrays at one layer.
struct Layer {
  const uint8_t* packed;  // [O, I * bits / 8]
  const uint8_t* scale;   // [ceil(O / block_rows), G] of the scale dtype
  const int16_t* zero;    // [O, G], or null: 2^(bits - 1) (none for float8)
  int64_t O, I, G;
  int64_t group;  // columns a scale covers, G = ceil(I / group): an FP8 row's last may be short
  int bits;
  int64_t block_rows;  // weight rows a row of scales covers: 1, or an FP8 block's
};

// Scratch vectors that live as long as the thread, for the rows of each call it runs
// (allocating them at each call took a quarter of a one-row product of W [192, 576]).
inline vf32* scratch(int64_t num_vectors) {
  thread_local std::vector<vf32> vectors;
  if (static_cast<int64_t>(vectors.size()) < num_vectors) vectors.resize(num_vectors);
  return vectors.data();
}

// One output row's scales and zero points as float32, and `num_tables` vectors of the row
// type's own (vectors: each table aligned, as one over two cache lines is two loads), in
// `store`.
template <Scale S>
class Groups {
 public:
  static int64_t num_vectors(const Layer& w, int64_t num_tables) {
    return 2 * (w.G / N + 1) + num_tables;
  }

  Groups() = default;
  Groups(const Layer& w, vf32* store)
      : w_(&w),
        per_group_(w.group / kRun),
        s_(reinterpret_cast<float*>(store)),
        z_(s_ + N * (w.G / N + 1)),
        tables_(store + 2 * (w.G / N + 1)) {
    std::fill_n(z_, w.G, static_cast<float>(1 << (w.bits - 1)));
  }

  int64_t num_groups() const { return w_->G; }
  int64_t runs_per_group() const { return per_group_; }
  // The run past group g's last.
  int64_t group_end(int64_t g) const { return std::min((g + 1) * per_group_, w_->I / kRun); }

  void read(int64_t o) {
    constexpr int64_t kBytes = S == Scale::kF32 ? 4 : 2;
    const Layer& w = *w_;
    const uint8_t* scales = w.scale + o / w.block_rows * w.G * kBytes;
    const uint8_t* ahead = w.scale + (o + kRowsAhead) / w.block_rows * w.G * kBytes;
    for (int64_t i = 0; i < w.G * kBytes; i += 64) {
      __builtin_prefetch(ahead + i);
      if (w.zero != nullptr) __builtin_prefetch(w.zero + (o + kRowsAhead) * w.G + i / kBytes);
    }
    for (int64_t i = 0; i < w.I * w.bits / 8; i += 64) {
      __builtin_prefetch(w.packed + (o + kRowsAhead) * w.I * w.bits / 8 + i);
    }
    scales_to_floats<S>(scales, w.G, s_);
    if (w.zero != nullptr) zeros_to_floats(w.zero + o * w.G, w.G, z_);
  }

 protected:
  const Layer* w_ = nullptr;
  int64_t per_group_ = 0;  // runs of 32 columns in a group
  float* s_ = nullptr;     // [G]
  float* z_ = nullptr;     // [G]
  vf32* tables_ = nullptr;
};

// Lanes of `table` (16 values) at the low 4 bits of each lane of idx.
JVLLM_INLINE vf32 lookup(vi32 idx, const float* table) {
#if defined(__AVX512F__)
  return vf32(_mm512_permutexvar_ps(static_cast<__m512i>(idx), _mm512_loadu_ps(table)));
#elif defined(__AVX2__)
  const __m256i i = static_cast<__m256i>(idx);
  const __m256 low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), i);
  const __m256 high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 8), i);
  const __m256 is_high = _mm256_castsi256_ps(_mm256_slli_epi32(i, 28));  // bit 3
  return vf32(_mm256_blendv_ps(low, high, is_high));
#else
  return vf32([&](auto l) { return table[idx[l] & 15]; });
#endif
}

// A 4-bit weight's output row: a table of the 16 values of each group, as float32 or, for
// bfloat16 dot products (kDots), as 32 bfloat16 values: the table twice.
template <Scale S, bool kBF16, bool kDots>
class NibbleRow : public Groups<S> {
 public:
  static constexpr int kTable = kDots ? 1 : 16 / N;  // vectors a group

  static int64_t num_vectors(const Layer& w) { return Groups<S>::num_vectors(w, kTable * w.G); }
  using Groups<S>::Groups;

  void read(int64_t o) {
    Groups<S>::read(o);
    row_ = this->w_->packed + o * this->w_->I / 2;
    for (int64_t g = 0; g < this->w_->G; ++g) {
      vf32* table = this->tables_ + kTable * g;
      for (int j = 0; j < 16 / N; ++j) {
        const vi32 q([j](auto l) { return N * j + static_cast<int>(l); });
        const vf32 d = to_floats(q) - this->z_[g];
#ifdef JVLLM_BF16_DOTS
        if constexpr (kDots) {  // rounded to bfloat16 by the conversion
          const __m512 w = static_cast<__m512>(scaled<S>(d, this->s_[g]));
          const __m256i t = (__m256i)_mm512_cvtneps_pbh(w);
          table[0] = vf32(_mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(t), t, 1)));
          continue;
        }
#endif
        table[j] = make_values<S, kBF16>(d, this->s_[g]);
      }
    }
  }

  // What run() needs of group g: its table.
  using Group = const float*;
  Group group(int64_t g) const {
    return reinterpret_cast<const float*>(this->tables_ + kTable * g);
  }

  // Run k's 32 values in column order (byte j holds column j in its low nibble, 16 + j in its
  // high one), the run in group `table`.
  void run(int64_t k, Group table, vf32* w) const {
    const uint8_t* bytes = row_ + 16 * k;
    for (int h = 0; h < 16 / N; ++h) {
      const vi32 idx = widen_bytes(bytes + N * h);
      w[h] = lookup(idx, table);
      w[16 / N + h] = lookup(idx >> 4, table);
    }
  }

#ifdef JVLLM_BF16_DOTS
  // Run k's 32 values as bfloat16: with the table twice over 32 lanes, a byte's high nibble next
  // to the low one (bit 4 of a word's index) picks the same value.
  using GroupBF16 = __m512i;
  GroupBF16 group_bf16(int64_t g) const {
    return _mm512_castps_si512(static_cast<__m512>(this->tables_[g]));
  }

  __m512bh run_bf16(int64_t k, GroupBF16 table) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row_ + 16 * k));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(bytes),
                                                 _mm_srli_epi16(bytes, 4), 1);
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(both), table);
  }
#endif

 private:
  const uint8_t* row_ = nullptr;
};

// An 8-bit weight's output row: a byte a column, an integer less its group's zero point, or
// (kFP8) a float8 e4m3 value.
template <Scale S, bool kBF16, bool kFP8>
class ByteRow : public Groups<S> {
 public:
  static int64_t num_vectors(const Layer& w) { return Groups<S>::num_vectors(w, 0); }
  using Groups<S>::Groups;

  void read(int64_t o) {
    Groups<S>::read(o);
    row_ = this->w_->packed + o * this->w_->I;
  }

  // What run() needs of group g: its scale and zero point.
  struct Group {
    float s, z;
  };
  Group group(int64_t g) const { return {this->s_[g], this->z_[g]}; }

  void run(int64_t k, Group group, vf32* w) const {
    columns(k, group, w);
    for (int v = 0; v < V; ++v) w[v] = make_values<S, kBF16>(w[v], group.s);
  }

#ifdef JVLLM_BF16_DOTS
  using GroupBF16 = Group;
  GroupBF16 group_bf16(int64_t g) const { return group(g); }

  // Run k's 32 values as bfloat16, rounded by the conversion.
  __m512bh run_bf16(int64_t k, Group group) const {
    vf32 w[V];
    columns(k, group, w);
    for (int v = 0; v < V; ++v) w[v] = scaled<S>(w[v], group.s);
    return _mm512_cvtne2ps_pbh(static_cast<__m512>(w[1]), static_cast<__m512>(w[0]));
  }
#endif

 private:
  // Run k's values before their scale, exact in float32, into w[V].
  JVLLM_INLINE void columns(int64_t k, Group group, vf32* w) const {
    const uint8_t* bytes = row_ + kRun * k;
    static_assert(V % 2 == 0);
    for (int v = 0; v < V; v += 2) {
      if constexpr (kFP8) {
        load_e4m3(bytes + N * v, w[v], w[v + 1]);
      } else {
        w[v] = to_floats(widen_bytes(bytes + N * v)) - group.z;
        w[v + 1] = to_floats(widen_bytes(bytes + N * (v + 1))) - group.z;
      }
    }
  }

  const uint8_t* row_ = nullptr;
};

// A weight row of format F, its values for bfloat16 dot products where kDots.
template <Format F, Scale S, bool kBF16, bool kDots>
using RowOf = std::conditional_t<F == Format::kInt4, NibbleRow<S, kBF16, kDots>,
                                 ByteRow<S, kBF16, F == Format::kFP8>>;

// Rows of x as the products read them: float32, or bfloat16 bits where bf16_dots.
struct Rows {
  const void* x;  // [R, I]
  int64_t R, I;
};

// Adds run k's products of the kOuts weight rows at `rows` (the run in their groups `groups`)
// and the G rows of x at xs to acc, vector v of the run to chain v.
template <class Row, int kOuts, int G>
inline void add_run(const Row* rows, const typename Row::Group* groups, const float* xs,
                    int64_t I, int64_t k, vf32 (&acc)[kOuts][G][V]) {
  vf32 w[kOuts][V];
  JVLLM_UNROLLED for (int t = 0; t < kOuts; ++t) rows[t].run(k, groups[t], w[t]);
  JVLLM_UNROLLED for (int r = 0; r < G; ++r) {
    JVLLM_UNROLLED for (int v = 0; v < V; ++v) {
      const vf32 xv = load_lanes(xs + r * I + kRun * k + N * v);
      JVLLM_UNROLLED for (int t = 0; t < kOuts; ++t) {
        acc[t][r][v] = multiply_add(w[t][v], xv, acc[t][r][v]);
      }
    }
  }
}

// y[first + r, o + t] for the G rows of x from `first` and the kOuts weight rows at `rows`
// (rows o, o + 1, ...), each pair summing in V chains; group by group.
// The loops over a tile's weight rows, rows and chains are unrolled (JVLLM_UNROLLED), so that
// its sums stay in registers: AVX-512 1.03-1.13x faster at 1-32 rows (GCC 12 kept them in
// memory, indexed by the loop).
template <class Row, int kOuts, int G>
void tile_products(const Row* rows, const Rows& x, int64_t first, int64_t o, int64_t O,
                   float* y) {
  const float* xs = static_cast<const float*>(x.x) + first * x.I;
  vf32 acc[kOuts][G][V];
  JVLLM_UNROLLED for (int t = 0; t < kOuts; ++t) {
    JVLLM_UNROLLED for (int r = 0; r < G; ++r) {
      JVLLM_UNROLLED for (int v = 0; v < V; ++v) acc[t][r][v] = 0.f;
    }
  }
  // Every group's runs but the last's from per_group alone, as the trip count of a loop
  // that does not read the weight's width (a bound from min() made float32 products 10% slower)
  const int64_t per_group = rows[0].runs_per_group(), last = rows[0].num_groups() - 1;
  for (int64_t g = 0; g <= last; ++g) {
    typename Row::Group groups[kOuts];
    JVLLM_UNROLLED for (int t = 0; t < kOuts; ++t) groups[t] = rows[t].group(g);
    const int64_t end = g < last ? (g + 1) * per_group : rows[0].group_end(g);
    for (int64_t k = g * per_group; k < end; ++k) {
      add_run<Row, kOuts, G>(rows, groups, xs, x.I, k, acc);
    }
  }
  JVLLM_UNROLLED for (int t = 0; t < kOuts; ++t) {
    JVLLM_UNROLLED for (int r = 0; r < G; ++r) {
      vf32 sum = acc[t][r][0];
      JVLLM_UNROLLED for (int v = 1; v < V; ++v) sum += acc[t][r][v];
      y[(first + r) * O + o + t] = sum_lanes(sum);
    }
  }
}

#ifdef JVLLM_BF16_DOTS
// Adds run k's bfloat16 dot products of the kOuts weight rows at `rows` (in groups `groups`)
// and the G rows of x at xs to chain c of acc.
template <int c, class Row, int kOuts, int G>
inline void add_run_bf16(const Row* rows, const typename Row::GroupBF16* groups,
                         const uint16_t* xs, int64_t I, int64_t k, __m512 (&acc)[kOuts][G][2]) {
  __m512bh w[kOuts];
  JVLLM_UNROLLED for (int t = 0; t < kOuts; ++t) w[t] = rows[t].run_bf16(k, groups[t]);
  JVLLM_UNROLLED for (int r = 0; r < G; ++r) {
    const __m512bh xr = (__m512bh)_mm512_loadu_si512(xs + r * I + kRun * k);
    JVLLM_UNROLLED for (int t = 0; t < kOuts; ++t) {
      acc[t][r][c] = _mm512_dpbf16_ps(acc[t][r][c], w[t], xr);
    }
  }
}

// tile_products with bfloat16 dot products: each pair in two chains, a group's runs taking
// turns from the first.
template <class Row, int kOuts, int G>
void tile_products_bf16(const Row* rows, const Rows& x, int64_t first, int64_t o, int64_t O,
                        float* y) {
  const uint16_t* xs = static_cast<const uint16_t*>(x.x) + first * x.I;
  __m512 acc[kOuts][G][2];
  JVLLM_UNROLLED for (int t = 0; t < kOuts; ++t) {
    JVLLM_UNROLLED for (int r = 0; r < G; ++r) {
      acc[t][r][0] = acc[t][r][1] = _mm512_setzero_ps();
    }
  }
  for (int64_t g = 0; g < rows[0].num_groups(); ++g) {
    typename Row::GroupBF16 groups[kOuts];
    JVLLM_UNROLLED for (int t = 0; t < kOuts; ++t) groups[t] = rows[t].group_bf16(g);
    const int64_t end = rows[0].group_end(g);
    int64_t k = g * rows[0].runs_per_group();
    for (; k + 2 <= end; k += 2) {
      add_run_bf16<0, Row, kOuts, G>(rows, groups, xs, x.I, k, acc);
      add_run_bf16<1, Row, kOuts, G>(rows, groups, xs, x.I, k + 1, acc);
    }
    if (k < end) add_run_bf16<0, Row, kOuts, G>(rows, groups, xs, x.I, k, acc);
  }
  JVLLM_UNROLLED for (int t = 0; t < kOuts; ++t) {
    JVLLM_UNROLLED for (int r = 0; r < G; ++r) {
      const __m512 sum = _mm512_add_ps(acc[t][r][0], acc[t][r][1]);
      y[(first + r) * O + o + t] = _mm512_reduce_add_ps(sum);
    }
  }
}
#endif

// The products of G rows of x from `first` with the tile's num_outs weight rows from o, kOuts
// at a time.
template <class Row, bool kBF16, int G>
void group_products(const Row* tile, int num_outs, const Rows& x, int64_t first, int64_t o,
                    int64_t O, float* y) {
  int t = 0;
#ifdef JVLLM_BF16_DOTS
  if constexpr (kBF16) {
    for (; t + kOuts <= num_outs; t += kOuts) {
      tile_products_bf16<Row, kOuts, G>(tile + t, x, first, o + t, O, y);
    }
    if (t < num_outs) tile_products_bf16<Row, 1, G>(tile + t, x, first, o + t, O, y);
    return;
  }
#endif
  for (; t + kOuts <= num_outs; t += kOuts) {
    tile_products<Row, kOuts, G>(tile + t, x, first, o + t, O, y);
  }
  if (t < num_outs) tile_products<Row, 1, G>(tile + t, x, first, o + t, O, y);
}

// Output rows [o_first, o_last) of y [R, O] = x @ W.T, kOuts at a time for up to kRows rows of
// x, else kTile at a time: each group of kRows rows of x (then 2 and 1) meets the tile's rows
// in turn, kOuts at a time, so that it is read from the cache once a tile rather than once a
// weight row, and each vector of it once for kOuts weight rows (32 rows times W [1536, 576]:
// 894 -> 414 us).
template <Format F, Scale S, bool kBF16>
void dense_rows(const Layer& w, const Rows& x, int64_t o_first, int64_t o_last, float* y) {
  using Row = RowOf<F, S, kBF16, bf16_dots<kBF16>()>;
  const int64_t tile_outs = x.R > kRows ? kTile : kOuts;
  vf32* store = scratch(tile_outs * Row::num_vectors(w));
  Row tile[kTile];
  for (int t = 0; t < tile_outs; ++t) tile[t] = Row(w, store + t * Row::num_vectors(w));
  for (int64_t o = o_first; o < o_last; o += tile_outs) {
    const int num_outs = static_cast<int>(std::min<int64_t>(tile_outs, o_last - o));
    for (int t = 0; t < num_outs; ++t) tile[t].read(o + t);
    int64_t first = 0;
    for (; first + kRows <= x.R; first += kRows) {
      group_products<Row, kBF16, kRows>(tile, num_outs, x, first, o, w.O, y);
    }
    if (kRows > 2 && first + 2 <= x.R) {
      group_products<Row, kBF16, 2>(tile, num_outs, x, first, o, w.O, y);
      first += 2;
    }
    if (first < x.R) group_products<Row, kBF16, 1>(tile, num_outs, x, first, o, w.O, y);
  }
}

// Rows [o_first, o_last) of W's values into out [O, I]: float32, or bfloat16 bits.
template <Format F, Scale S, bool kBF16>
void dequantize_rows(const Layer& w, int64_t o_first, int64_t o_last, void* out) {
  using Row = RowOf<F, S, kBF16, false>;
  Row row(w, scratch(Row::num_vectors(w)));
  for (int64_t o = o_first; o < o_last; ++o) {
    row.read(o);
    for (int64_t k = 0; k < w.I / kRun; ++k) {
      vf32 values[V];
      row.run(k, row.group(k / row.runs_per_group()), values);
      const int64_t at = o * w.I + kRun * k;
      for (int v = 0; v < V; ++v) {
        if constexpr (kBF16) {
          store_rounded(values[v], static_cast<uint16_t*>(out) + at + N * v);
        } else {
          values[v].copy_to(static_cast<float*>(out) + at + N * v, stdx::element_aligned);
        }
      }
    }
  }
}

// Calls fn(format, scale, bf16) with each as a compile-time constant.
template <typename Fn>
void dispatch(Format format, Scale scale, bool bf16, const Fn& fn) {
  auto with_model = [&](auto f, auto s) {
    bf16 ? fn(f, s, std::true_type{}) : fn(f, s, std::false_type{});
  };
  auto with_scale = [&](auto f) {
    using F16 = std::integral_constant<Scale, Scale::kF16>;
    using BF16 = std::integral_constant<Scale, Scale::kBF16>;
    using F32 = std::integral_constant<Scale, Scale::kF32>;
    scale == Scale::kF16 ? with_model(f, F16{})
                         : (scale == Scale::kBF16 ? with_model(f, BF16{}) : with_model(f, F32{}));
  };
  switch (format) {
    case Format::kInt4: return with_scale(std::integral_constant<Format, Format::kInt4>{});
    case Format::kInt8: return with_scale(std::integral_constant<Format, Format::kInt8>{});
    case Format::kFP8: return with_scale(std::integral_constant<Format, Format::kFP8>{});
  }
}

// The layout of W's scales: weight rows and columns that a scale covers.
struct Blocks {
  int64_t rows, columns;
};

// Layer `at` of packed [L, O, I * bits / 8] (u8, or f8e4m3fn [L, O, I]), scale [L, ceil(O /
// blocks.rows), G = ceil(I / blocks.columns)] and zero (none, or i16[L, O, G]; none for float8)
// for W [O, I]; an error where they do not fit together.
ffi::Error layer_of(ffi::AnyBuffer& packed, ffi::AnyBuffer& scale, ffi::RemainingArgs& zero,
                    int64_t at, int64_t I, Blocks blocks, Layer* w, Format* format,
                    Scale* scale_type) {
  const int64_t block_rows = blocks.rows, group = blocks.columns;
  auto p = packed.dimensions(), s = scale.dimensions();
  const bool fp8 = packed.element_type() == ffi::F8E4M3FN;
  if (!fp8 && packed.element_type() != ffi::U8) {
    return ffi::Error::InvalidArgument("int_group: packed u8 or float8_e4m3fn");
  }
  if (p.size() != 3 || s.size() != 3 || s[0] != p[0] || block_rows <= 0 ||
      s[1] != (p[1] + block_rows - 1) / block_rows || I <= 0 || (8 * p[2]) % I != 0 ||
      zero.size() > (fp8 ? 0 : 1)) {
    return ffi::Error::InvalidArgument(
        "int_group: packed [L, O, I*bits/8], scale [L, ceil(O/block_rows), G], no zero for fp8");
  }
  const int64_t L = p[0], O = p[1], G = s[2];
  const int bits = static_cast<int>(8 * p[2] / I);
  if ((bits != 4 && bits != 8) || (fp8 && bits != 8) || group <= 0 || group % kRun != 0 ||
      I % kRun != 0 || G != (I + group - 1) / group || (!fp8 && I % group != 0) || at < 0 ||
      at >= L) {
    return ffi::Error::InvalidArgument(
        "int_group: 4 or 8 bits, I and groups of 32k (whole but for fp8), layer in [0, L)");
  }
  *format = fp8 ? Format::kFP8 : (bits == 4 ? Format::kInt4 : Format::kInt8);
  switch (scale.element_type()) {
    case ffi::F16: *scale_type = Scale::kF16; break;
    case ffi::BF16: *scale_type = Scale::kBF16; break;
    case ffi::F32: *scale_type = Scale::kF32; break;
    default: return ffi::Error::InvalidArgument("int_group: scale f16, bf16 or f32");
  }
  const int16_t* zeros = nullptr;
  if (zero.size() == 1) {
    auto z = zero.get<ffi::Buffer<ffi::S16>>(0);
    if (z.has_error()) return z.error();
    if (static_cast<int64_t>(z->element_count()) != L * O * G) {
      return ffi::Error::InvalidArgument("int_group: zero i16 [L, O, G]");
    }
    zeros = z->typed_data() + at * O * G;
  }
  const int64_t scale_bytes = static_cast<int64_t>(scale.size_bytes()) / L;
  *w = Layer{static_cast<const uint8_t*>(packed.untyped_data()) + at * O * p[2],
             static_cast<const uint8_t*>(scale.untyped_data()) + at * scale_bytes,
             zeros, O, I, G, group, bits, block_rows};
  return ffi::Error::Success();
}

ffi::Error int_group_dense(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> layer,
                           ffi::AnyBuffer packed, ffi::AnyBuffer scale, ffi::RemainingArgs zero,
                           ffi::ResultBuffer<ffi::F32> y, int64_t block_rows,
                           int64_t group_size) {
  auto x_dims = x.dimensions();
  const bool bf16 = x.element_type() == ffi::BF16;
  if (x_dims.size() != 2 || x_dims[0] > kMaxRows || (!bf16 && x.element_type() != ffi::F32)) {
    return ffi::Error::InvalidArgument("int_group_dense: x f32 or bf16 [R <= 32, I]");
  }
  const int64_t R = x_dims[0], I = x_dims[1];
  Layer w;
  Format format;
  Scale scale_type;
  ffi::Error error = layer_of(packed, scale, zero, layer.typed_data()[0], I,
                              {block_rows, group_size}, &w, &format, &scale_type);
  if (error.failure()) return error;
  if (static_cast<int64_t>(y->element_count()) != R * w.O) {
    return ffi::Error::InvalidArgument("int_group_dense: y [R, O]");
  }
  // A bfloat16 model's rows as float32 where its values meet them in fused multiply-adds.
  std::vector<float> x_f32(bf16 && !bf16_dots<true>() ? R * I : 0);
  const auto* x_bf16 = static_cast<const uint16_t*>(x.untyped_data());
  for (size_t i = 0; i < x_f32.size(); ++i) x_f32[i] = bfloat16_to_float(x_bf16[i]);
  const Rows rows{x_f32.empty() ? x.untyped_data() : x_f32.data(), R, I};
  float* out = y->typed_data();
  dispatch(format, scale_type, bf16, [&](auto f, auto s, auto model) {
    jvllm::parallel_ranges(pool, w.O, 8, w.O / 16, [&](int64_t first, int64_t last) {
      dense_rows<decltype(f)::value, decltype(s)::value, decltype(model)::value>(w, rows, first,
                                                                                last, out);
    });
  });
  return ffi::Error::Success();
}

ffi::Error int_group_dequantize(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer,
                                ffi::AnyBuffer packed, ffi::AnyBuffer scale,
                                ffi::RemainingArgs zero, ffi::Result<ffi::AnyBuffer> out,
                                int64_t block_rows, int64_t group_size) {
  auto dims = out->dimensions();
  const bool bf16 = out->element_type() == ffi::BF16;
  if (dims.size() != 2 || (!bf16 && out->element_type() != ffi::F32)) {
    return ffi::Error::InvalidArgument("int_group_dequantize: out f32 or bf16 [O, I]");
  }
  Layer w;
  Format format;
  Scale scale_type;
  const int64_t at = layer.typed_data()[0];
  ffi::Error error = layer_of(packed, scale, zero, at, dims[1], {block_rows, group_size}, &w,
                              &format, &scale_type);
  if (error.failure()) return error;
  if (dims[0] != w.O) return ffi::Error::InvalidArgument("int_group_dequantize: out [O, I]");
  void* values = out->untyped_data();
  dispatch(format, scale_type, bf16, [&](auto f, auto s, auto model) {
    jvllm::parallel_ranges(pool, w.O, 8, w.O, [&](int64_t first, int64_t last) {
      dequantize_rows<decltype(f)::value, decltype(s)::value, decltype(model)::value>(
          w, first, last, values);
    });
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntGroupDense, int_group_dense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int64_t>("group_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntGroupDequantize, int_group_dequantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int64_t>("group_size"));
